"""`shoal bench offline`: one fixed workload through shoal and its peers,
in one run, with the compute roofline of this machine.

Workload: N requests (seeded by --seed, the engine's), prompts of random
token ids with lengths uniform in 32..512, outputs uniform in 32..256,
ignore_eos. Peers, in the dtype shoal resolves: transformers' continuous
batching (ContinuousBatchingManager, each request with its own
max_new_tokens) and plain batched generate in batches of 16.
With --tensor-parallel-size K > 1, shoal also runs at K = 1 on the same
cores, and the table gives both step times.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time

from shoal.workers.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("offline", help="offline throughput against transformers")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    p.add_argument("--peers", default="cb,generate", help="comma list of: cb, generate (or none)")
    p.add_argument("--generate-batch", type=int, default=16)
    p.add_argument("--output", default="bench_results/offline.json")
    EngineArgs.add_cli_args(p)  # its --seed seeds the workload too
    p.set_defaults(func=run)


def make_workload(n: int, seed: int, input_len, output_len, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*input_len)
        work.append(([rng.randrange(vocab) for _ in range(plen)], rng.randint(*output_len)))
    return work


def measure_matmul_flops(seconds: float = 2.0) -> float:
    """This machine's float32 matmul rate (FLOP/s) on a large square matmul."""
    import torch

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def run_shoal(args: EngineArgs, work) -> dict:
    from shoal.workers import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:2]], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2)  # warm-up
    eng = llm.engine
    steps0, step_s0 = eng.num_steps, eng.step_seconds
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [n for _, n in work]
    stats = eng.stats()
    steps = eng.num_steps - steps0
    # Parameters of the whole model (each rank holds 1/K of most of them).
    params = sum(p.numel() for p in eng.runner.model.parameters()) if args.tensor_parallel_size == 1 else None
    result = {"seconds": dt, "preemptions": stats.num_preemptions, "load_s": eng.load_time_s, "steps": steps,
              "step_ms": 1000 * (eng.step_seconds - step_s0) / max(steps, 1), "params": params,
              "tensor_parallel_size": eng.args.tensor_parallel_size, "outputs": [o.token_ids for o in outs]}  # fmt: skip
    llm.shutdown()
    return result


def hf_model(path: str, dtype):
    """transformers' model of an HF folder or a GGUF file, for comparison."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).eval()  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_hf_cb(model, work) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    got = {}
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=30) as manager:
        for i, (ids, n) in enumerate(work):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(got) < len(work):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                got[res.request_id] = len(res.generated_tokens)
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
    dt = time.perf_counter() - t0
    assert sorted(got.values()) == sorted(n for _, n in work), "a request got the wrong number of tokens"
    return {"seconds": dt}


def run_hf_generate(model, work, batch: int) -> dict:
    """Static batches (left-padded): each batch runs to its longest output;
    only each request's own max_new_tokens count as output."""
    import torch

    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(n for _, n in chunk),
                           min_new_tokens=max(n for _, n in chunk), eos_token_id=None, pad_token_id=0)  # fmt: skip
    return {"seconds": time.perf_counter() - t0}


def run(ns) -> int:
    import torch

    from shoal.workers.model_executor.model_loader import resolve_model

    peak = measure_matmul_flops()
    print(f"float32 matmul rate on this machine: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    from shoal.workers.model_executor.model_loader import load_model_files

    args = EngineArgs.from_cli_args(ns)
    cfg = load_model_files(args.model).config
    cfg.check_tp_size(args.tensor_parallel_size)  # before anything runs
    vocab = cfg.vocab_size
    work = make_workload(ns.num_prompts, args.seed, ns.input_len, ns.output_len, vocab)
    n_in, n_out = sum(len(p) for p, _ in work), sum(n for _, n in work)
    print(f"workload: {len(work)} requests, {n_in} prompt tokens, {n_out} output tokens (seed {args.seed})")

    results = {}
    tp = args.tensor_parallel_size
    if tp > 1:
        one = run_shoal(dataclasses.replace(args, tensor_parallel_size=1), work)
        print(f"shoal K=1: {one['seconds']:.1f} s, {one['step_ms']:.1f} ms/step", flush=True)
    s = run_shoal(args, work)
    results["shoal" if tp == 1 else f"shoal K={tp}"] = s
    print(f"shoal{'' if tp == 1 else f' K={tp}'}: {s['seconds']:.1f} s, {s['step_ms']:.1f} ms/step "
          f"({s['preemptions']} preemptions)", flush=True)  # fmt: skip
    if tp > 1:
        results["shoal K=1"] = one
        s["same_tokens_as_k1"] = s["outputs"] == one["outputs"]
        s["params"] = one["params"]
    params = s["params"]
    for r in results.values():
        r.pop("outputs")
    peers = [p for p in ns.peers.split(",") if p and p != "none"]
    if peers:
        # The peers compute in the dtype shoal resolved, so the comparison stays like for like.
        hf = hf_model(resolve_model(args.model), args.resolved_dtype(args.resolved_device()))
        if "cb" in peers:
            results["transformers continuous batching"] = run_hf_cb(hf, work)
            print(f"transformers CB: {results['transformers continuous batching']['seconds']:.1f} s", flush=True)
        if "generate" in peers:
            key = f"transformers generate (batches of {ns.generate_batch})"
            results[key] = run_hf_generate(hf, work, ns.generate_batch)
            print(f"{key}: {results[key]['seconds']:.1f} s", flush=True)

    flops = 2 * params * (n_in + n_out)
    base = s["seconds"]
    first = next(iter(results))
    print()
    print(f"{'engine':<40} {'seconds':>8} {'out tok/s':>10} {first + ' is':>12} {'% roofline':>10} {'ms/step':>8}")
    for name, r in results.items():
        r["output_tok_s"] = n_out / r["seconds"]
        r["roofline_fraction"] = flops / r["seconds"] / peak
        ratio = r["seconds"] / base
        step = f"{r['step_ms']:>8.1f}" if "step_ms" in r else f"{'':>8}"
        print(f"{name:<40} {r['seconds']:>8.1f} {r['output_tok_s']:>10.1f} {ratio:>11.2f}x "
              f"{100 * r['roofline_fraction']:>9.1f}% {step}")  # fmt: skip
    if tp > 1:
        print(f"\nK={tp} step time is {s['step_ms'] / results['shoal K=1']['step_ms']:.2f}x K=1's on these "
              f"{os.cpu_count()} cores (all-reduce over gloo); same tokens as K=1: {s['same_tokens_as_k1']}")  # fmt: skip
    print(f"\nroofline: 2 x {params / 1e6:.1f}M params x {n_in + n_out} tokens = {flops / 1e12:.2f} TFLOP "
          f"at {peak / 1e9:.1f} GFLOP/s = {flops / peak:.1f} s")  # fmt: skip
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"workload": {"num_prompts": len(work), "seed": args.seed, "prompt_tokens": n_in,
                                "output_tokens": n_out}, "matmul_flops": peak, "params": params,
                   "results": results}, f, indent=2)  # fmt: skip
    print(f"wrote {ns.output}")
    return 0
