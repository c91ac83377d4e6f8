"""`shoal bench latency`, like vLLM's: one request at a time (a prompt of
--input-len random tokens, --output-len tokens out, ignore_eos), repeated,
with the time to first token and the time per output token (p50/p99), and
the memory floor of a decode step: the model's weight bytes over the read
bandwidth this bench measures on this machine (a large tensor's sum on the
engine's threads, best of several). A decode step at batch 1 reads every
weight once, so it cannot beat that floor; the ratio says how far off it is.
Peer (--peers): llama.cpp through llama-cpp-python (llamacpp_peer.py) on the
same .gguf file, prompts, output length and threads, one stream, where the
package is installed; otherwise a line says so and the bench carries on.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs

PEERS = ("llamacpp",)


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="one request at a time: TTFT and per-token time against the memory floor")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--read-mib", type=int, default=512, help="size of the tensor the read bandwidth is measured on")
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile one more request's decode steps (torch.profiler) and print where a step goes; "
        "then a table of each part's share of a step for one stream, --profile-batch sequences decoding, "
        "and those with a --profile-prefill-len prompt in the same step",
    )
    p.add_argument("--profile-batch", type=int, default=16, help="--profile: sequences decoding in the batched steps")
    p.add_argument(
        "--profile-prefill-len", type=int, default=512, help="--profile: the prompt prefilled beside the batch"
    )
    p.add_argument(
        "--peers",
        default="llamacpp",
        help="comma list of: llamacpp (or none): llama.cpp on the same .gguf file, threads and prompts, "
        "where llama-cpp-python is installed",
    )
    p.add_argument("--output", default="bench_results/latency.json")
    EngineArgs.add_cli_args(p)  # its --seed seeds the prompts
    p.set_defaults(func=run)


def read_bandwidth(mib: int, device, reps: int = 5) -> float:
    """Bytes/s of a plain read: sum() over a `mib` MiB float32 tensor, best of reps."""
    import torch

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(reps + 1):  # the first pass pages it in
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step at batch 1 reads, each storage once
    (tied weights are one; buffers such as rotary tables are left out: a step
    reads a few rows). Of a mixture of experts' layers, a token reads its
    top-k experts only."""
    seen, total = set(), 0
    for t in model.parameters():
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for m in _moe_layers(model):
        unread = m.w13_weight.shape[0] - min(m.top_k, m.w13_weight.shape[0])
        total -= unread * _bytes_per_expert(m)
    return total


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(engine, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    """(TTFT s, the gaps between the request's later tokens in s)."""
    from shoal.workers import SamplingParams

    rid = f"latency-{time.perf_counter_ns()}"
    t0 = time.perf_counter()
    engine.add_request(
        GenerateRequest(
            rid, engine.tokenize(prompt), SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        )
    )
    times = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times.extend([time.perf_counter()] * len(out.new_token_ids))
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def run(ns) -> int:
    from shoal.workers import LLMEngine

    peers = chosen_peers(ns)  # checked before the engine starts
    args = EngineArgs.from_cli_args(ns)
    engine = LLMEngine(args)
    runner = engine.runner
    model = getattr(runner, "model", None)
    if model is None:
        raise ValueError("bench latency needs a model with weights (not load_format simulated)")
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(ns.input_len)] for _ in range(ns.num_iters + ns.num_iters_warmup)]
    ttfts, tpots = [], []
    for i, prompt in enumerate(prompts):
        ttft, gaps = measure(engine, prompt, ns.output_len)
        if i >= ns.num_iters_warmup:
            ttfts.append(ttft)
            tpots.extend(gaps)
    device = next(model.parameters()).device
    bw = read_bandwidth(ns.read_mib, device)
    nbytes = weight_bytes(model)
    floor = nbytes / bw
    tpot50, tpot99 = statistics.median(tpots), _pct(tpots, 0.99)
    report = {
        "model": engine.model_name,
        "dtype": str(model.dtype),
        "weight_dtype": str(model.lm_head.weight.dtype),
        "device": str(device),
        "threads": args.num_threads or os.cpu_count(),
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "num_iters": ns.num_iters,
        "ttft_ms": {"p50": statistics.median(ttfts) * 1e3, "p99": _pct(ttfts, 0.99) * 1e3},
        "tpot_ms": {"p50": tpot50 * 1e3, "p99": tpot99 * 1e3},
        "weight_bytes": nbytes,
        "read_bandwidth_gb_s": bw / 1e9,
        "memory_floor_ms": floor * 1e3,
        "tpot_over_floor": tpot50 / floor,
    }
    print(
        f"{report['model']} ({report['dtype']}, weights {report['weight_dtype']}, {report['device']}), "
        f"prompt {ns.input_len}, {ns.output_len} out, "
        f"{ns.num_iters} requests after {ns.num_iters_warmup} warm-up"
    )
    print(f"  time to first token   p50 {report['ttft_ms']['p50']:8.1f} ms   p99 {report['ttft_ms']['p99']:8.1f} ms")
    print(
        f"  time per output token p50 {report['tpot_ms']['p50']:8.2f} ms   p99 {report['tpot_ms']['p99']:8.2f} ms"
        f"   ({1 / tpot50:.1f} tok/s)"
    )
    print(
        f"  memory floor          {floor * 1e3:8.2f} ms   ({nbytes / 1e6:.0f} MB of weights / {bw / 1e9:.1f} GB/s read)"
    )
    print(f"  per-token time / floor {tpot50 / floor:.2f}x")
    if "llamacpp" in peers:
        peer = run_llamacpp(args.model, prompts, ns, report["threads"])
        if peer:
            report["peers"] = {"llama.cpp": peer}
    if ns.profile:
        report["profile"] = profile(engine, prompts[-1], ns.output_len)
        report["step_profile"] = profile_parts(engine, ns, rng)
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {ns.output}")
    engine.shutdown()
    return 0


def chosen_peers(ns) -> list[str]:
    peers = [p for p in ns.peers.split(",") if p and p != "none"]
    if set(peers) - set(PEERS):
        raise ValueError(f"--peers takes {', '.join(PEERS)} or none; got {ns.peers!r}")
    return peers


def run_llamacpp(model: str | None, prompts: list[list[int]], ns, threads: int) -> dict | None:
    """llama.cpp on the same prompts, output length and threads, one stream;
    prints its figures under shoal's (or why it did not run)."""
    from shoal.benchmarks import llamacpp_peer
    from shoal.workers.model_executor.loader.model_loader import resolve_model

    r = llamacpp_peer.run_latency(resolve_model(model), prompts, ns.output_len, threads, ns.num_iters_warmup)
    if r is None:
        return None
    s = llamacpp_peer.summarize(r, _pct)
    print(f"llama.cpp {s['version']} (llama-cpp-python), same file, prompts and {threads} threads:")
    print(f"  time to first token   p50 {s['ttft_ms']['p50']:8.1f} ms   p99 {s['ttft_ms']['p99']:8.1f} ms")
    print(
        f"  time per output token p50 {s['tpot_ms']['p50']:8.2f} ms   p99 {s['tpot_ms']['p99']:8.2f} ms"
        f"   ({s['decode_tok_s']:.1f} tok/s)"
    )
    return s


def profile(engine, prompt: list[int], output_len: int) -> dict:
    """Where one request's decode steps go: the engine's named step ranges
    (shoal.workers.profiling) for one more request, the decoder layers and
    the LM head timed through module hooks (or, in the one-call decode step,
    its own range), then, inside the one-call decoder layers, each op (norms,
    each matrix with its read rate, RoPE, attention, SiLU) as the C++ step
    times it. Without the compiled kernels, each matrix is timed alone at one
    row instead. Printed and returned."""
    import torch

    from shoal.workers import SamplingParams, profiling

    runner = engine.runner
    model = runner.model
    decode_step = runner.cpu_decode_step
    fused = decode_step is not None
    hooked = {"decoder layers": 0.0, "LM head": 0.0}
    modules = [(model.lm_head, "LM head")] + ([] if fused else [(layer, "decoder layers") for layer in model.layers])
    handles = []
    for module, part in modules:
        handles += _time_module(module, hooked, part)

    experts = _moe_layers(model)
    attn_matrices = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
    if experts:  # and, to compare their read rate with in the same steps, the attention matrices
        hooked["experts"] = hooked["attention matrices"] = 0.0
        for m in experts:
            handles += _time_module(m, hooked, "experts")
        for m in attn_matrices:
            handles += _time_module(m, hooked, "attention matrices")
    engine.add_request(
        GenerateRequest(
            "profile", engine.tokenize(prompt), SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        )
    )
    engine.step()  # the prefill, not counted
    for k in hooked:
        hooked[k] = 0.0
    expert_bytes = 0  # the expert weights the counted steps read: each step, its picked experts' matrices
    if fused:
        layers = decode_step.bound_layers()
        layers.timing = True  # its ops time themselves (read back below)
        layers.op_seconds()  # zeroes them
    profiling.enable()
    steps, step = 0, 0.0
    try:
        while engine.has_unfinished_requests():
            before = [m.expert_load().clone() for m in experts]
            t0 = time.perf_counter()
            engine.step()
            step += time.perf_counter() - t0
            steps += 1
            for m, b in zip(experts, before):
                picked = int(((m.expert_load() - b) > 0).sum())
                expert_bytes += picked * _bytes_per_expert(m)
        ranges = profiling.seconds()
    finally:
        profiling.enable(False)
        for h in handles:
            h.remove()
    if fused:
        op_seconds = layers.op_seconds()
        layers.timing = False
    r = {name: ranges.get(name, 0.0) for name in profiling.RANGES}
    parts = {
        "decoder layers": r["decoder_layers"] if fused else hooked["decoder layers"],
        "LM head": hooked["LM head"],
        "forward": r["forward"],
        "sampler": r["sample"],
        "runner": r["execute_model"] - r["forward"] - r["sample"],  # staging and the runner's own Python
        "scheduler": r["schedule"] + r["update_from_output"],
        "detokenizer": r["detokenize"],
        "engine": step - r["schedule"] - r["execute_model"] - r["update_from_output"] - r["detokenize"],
    }
    rows = [
        ("decoder layers", parts["decoder layers"]),
        ("LM head", parts["LM head"]),
        (
            "rest of the forward (embedding, final norm, Python)",
            parts["forward"] - parts["decoder layers"] - parts["LM head"],
        ),
        ("sampler", parts["sampler"]),
        ("input staging (token ids, positions, slots, one copy)", parts["runner"]),
        ("scheduler (schedule, update from output)", parts["scheduler"]),
        ("detokenizer and output deltas", parts["detokenizer"]),
        ("rest of the step (engine bookkeeping)", parts["engine"]),
    ]
    print(
        f"  one decode step, {1e3 * step / steps:.2f} ms ({steps} steps of one request; "
        f"{'decoder layers in one compiled call' if fused else 'per-layer torch path'}):"
    )
    for name, sec in rows:
        print(f"    {name:52} {1e3 * sec / steps:7.2f} ms {100 * sec / step:5.1f}%")
    dense_mlps = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "gate_up_proj")]
    matrices = {
        "qkv_proj": [layer.self_attn.qkv_proj for layer in model.layers],
        "o_proj": [layer.self_attn.o_proj for layer in model.layers],
        "gate_up_proj": [mlp.gate_up_proj for mlp in dense_mlps],
        "down_proj": [mlp.down_proj for mlp in dense_mlps],
        "lm_head": [model.lm_head],
    }
    matrices = {n: ms for n, ms in matrices.items() if ms}
    nbytes = {n: sum(m.weight.numel() * m.weight.element_size() for m in ms) for n, ms in matrices.items()}
    rates, report = {}, {"step_ms": 1e3 * step / steps, "parts_ms": {n: 1e3 * s / steps for n, s in rows}}

    def rate(name, ms):
        rates[name] = {"bytes": nbytes[name], "ms": ms, "gb_s": nbytes[name] / ms / 1e6}
        return f"{nbytes[name] / 1e6:7.1f} MB {ms:7.2f} ms {rates[name]['gb_s']:6.1f} GB/s"

    if fused:  # each op as it ran inside the steps above
        ops = {n: 1e3 * s / steps for n, s in op_seconds.items()}
        report["decoder_ops_ms"] = ops
        print(
            f"  inside the decoder layers, each op over all {len(model.layers)} layers, per step "
            "(a matrix's rate is its bytes over its op's time):"
        )
        for name, ms in ops.items():
            print(f"    {name:22} {rate(name, ms) if name in nbytes else f'{ms:18.2f} ms'}")
        print(f"    {'lm_head':22} {rate('lm_head', report['parts_ms']['LM head'])}")
    else:  # each matrix alone at one row, all layers' copies in turn (from memory, not cache), best of 5
        print("  each matrix at one row, read from memory (all layers' copies in turn, best of 5):")
        device, dtype = runner.device, runner.dtype  # activations as the steps have them
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            for name, layers in matrices.items():
                xs = [torch.randn(1, m.weight.shape[1], device=device, dtype=dtype) for m in layers]
                best = float("inf")
                for _ in range(6):
                    sync()
                    t0 = time.perf_counter()
                    for m, x in zip(layers, xs):
                        m(x)
                    sync()
                    best = min(best, time.perf_counter() - t0)
                print(f"    {name:14} x{len(layers):<3} {rate(name, best * 1e3)}")
    report["matrices"] = rates
    if experts:
        attn_bytes = steps * sum(m.weight.numel() * m.weight.element_size() for m in attn_matrices)
        attn = (hooked["attention matrices"], attn_bytes)
        report["experts"] = _report_experts((hooked["experts"], expert_bytes), attn, steps, len(experts))
    return report


def profile_parts(engine, ns, rng) -> list[dict]:
    """Each part's share of a step (benchmarks/step_profile.py): one stream,
    a batch decoding, and the batch with a prompt's prefill; printed and returned."""
    from shoal.benchmarks.step_profile import profile_steps

    print("  each part's share of a step (linear layers by the arithmetic they multiply in):")
    steps = profile_steps(engine, ns.input_len, ns.profile_batch, ns.profile_prefill_len, max(4, ns.output_len), rng)
    for p in steps:
        p.print()
    return [p.as_dict() for p in steps]


def _moe_layers(model) -> list:
    from shoal.workers.model_executor.layers.fused_moe.layer import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _bytes_per_expert(m) -> int:
    """One local expert's gate/up and down matrices, as stored."""
    w13, w2 = m.w13_weight, m.w2_weight
    return (w13[0].numel() * w13.element_size()) + (w2[0].numel() * w2.element_size())


def _report_experts(experts: tuple[float, int], dense: tuple[float, int], steps: int, num_layers: int) -> dict:
    """The expert GEMMs' read rate inside the decode steps (the picked experts'
    bytes over the time in the fused MoE layers, routing and sorting included)
    beside the attention matrices' in the same steps; each (seconds, bytes)."""

    def per_step(seconds: float, nbytes: int) -> tuple[float, float, float]:
        ms, mb = 1e3 * seconds / steps, nbytes / steps / 1e6
        return mb, ms, mb / ms

    mb, ms, gb_s = per_step(*experts)
    dense_mb, dense_ms, dense_gb_s = per_step(*dense)
    print(f"  in the same steps, per step ({num_layers} MoE layers; experts: the picked ones' matrices):")
    print(f"    {'experts':22} {mb:7.1f} MB {ms:7.2f} ms {gb_s:6.1f} GB/s")
    print(f"    {'attention matrices':22} {dense_mb:7.1f} MB {dense_ms:7.2f} ms {dense_gb_s:6.1f} GB/s")
    print(f"    the experts read at {100 * gb_s / dense_gb_s:.0f}% of the attention matrices' rate")
    return {
        "mb_per_step": mb,
        "ms": ms,
        "gb_s": gb_s,
        "dense_mb_per_step": dense_mb,
        "dense_ms": dense_ms,
        "dense_gb_s": dense_gb_s,
        "ratio": gb_s / dense_gb_s,
    }


def _time_module(module, totals: dict, part: str) -> list:
    """Time each call of `module` into totals[part] through its forward hooks
    (PyTorch's own seam); returns the handles to remove."""
    started = []

    def before(*_):
        started.append(time.perf_counter())

    def after(*_):
        totals[part] += time.perf_counter() - started.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
