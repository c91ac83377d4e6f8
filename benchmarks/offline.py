"""`shoal bench offline`: workloads through shoal and its peers, in one run,
with each run's share of this machine's peak for the arithmetic it used
(roofline.py: float32 FMA, int8 or bfloat16 dot products).

Workloads (offline_workloads.py; --workload, seeded by --seed, the
engine's; random token ids, ignore_eos): default (64 requests, prompts
32..512 tokens, outputs 32..256), short (256; 16..128; 16..64), long (16;
1024..2048; 128..512) and chat (64; one 300-token system prompt shared by
all, then 16..128 of the user's; 32..256). `all` runs each in turn and ends
with one table of them. Peers, in the dtype shoal resolves and with sdpa
attention: transformers' continuous batching (ContinuousBatchingManager,
each request with its own max_new_tokens, its cache and batch sizes set per
workload in CB_SETTINGS and printed beside its result) and plain batched
generate in batches of 16. --peers vllm adds vLLM's CPU build (vllm_peer.py:
installed into its own environment on first use, fed the same token ids),
a row for each --vllm-dtype, and shoal again, unquantized, at each of those
dtypes its own run did not use.
With --tensor-parallel-size K > 1, shoal also runs at K = 1 on the same
cores, and the table gives both step times.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass

from shoal.benchmarks import vllm_peer
from shoal.benchmarks.offline_workloads import PRESETS, Workload, make_workload
from shoal.benchmarks.roofline import (
    INTEGER_METHODS,
    format_rooflines,
    format_share,
    measure_gemms,
    measure_rooflines,
    roofline_share,
)
from shoal.workers.engine_args import EngineArgs

PEERS = ("cb", "generate", "vllm")  # vllm: vLLM's CPU build, installed on first use (vllm_peer.py)
CB = "transformers continuous batching"


@dataclass(frozen=True, slots=True)
class CBSettings:
    """The ContinuousBatchingConfig fields set for one workload.

    transformers' paged cache with sdpa (no flash kernel on the CPU) packs a
    step's queries against every KV token the step reads, under one dense
    mask, so its attention grows with the requests in a step while its
    linear layers gain little past a few rows on 2 cores. Timed alone on
    `default` and `short` (2026-11-30; `bench tune-cb` runs such a sweep): at
    most 16 requests a step was fastest on both (8 to 96 were 3-24% slower); query
    tokens a step and page size moved it by at most 5%, noise-sized, and the
    fastest measured is kept: on `long` 2 requests a step (4% ahead of 4);
    on `chat` the preset, whose second run was the fastest of all (the same
    setting moved 17% between runs). Each cache holds a full step
    of requests at their longest with a quarter to spare, so no request is
    evicted and recomputed.
    """

    page_size: int  # tokens per cache page
    num_blocks: int  # cache capacity in pages; also caps the KV tokens one step reads
    max_batch_tokens: int  # query tokens one step computes: the prefill chunk
    max_requests_per_batch: int
    scheduler_type: str = "fifo"  # decoding requests first, prefills in the tokens left: no decode waits
    allow_block_sharing: bool = True  # prefix sharing, as shoal's prefix caching


CB_SETTINGS = {
    # timed on its first 32 requests: 262 s at 16 requests and 1,024 tokens a step; 2,048 tokens 257 s, 8 and 32
    # requests 276 and 270 s.
    "default": CBSettings(page_size=64, num_blocks=240, max_batch_tokens=2048, max_requests_per_batch=16),
    # timed on its first 96 requests: 148 s at 16 requests a step, 154 s at 32, 175 s at 64 (the setting before),
    # 183 s at 96; at 64 requests, 256 or 1,024 tokens a step and 32-token pages gave 167-170 s.
    "short": CBSettings(page_size=64, num_blocks=240, max_batch_tokens=512, max_requests_per_batch=16),
    # ~1.7k-token contexts; a whole 2,048-token prompt fits a step beside the decodes; transformers' own 256-token
    # pages, as at these lengths a part-filled page wastes little. Timed on its first 8 requests: 503 s at 2
    # requests a step, 522 s at 4 (the setting before), 537 s at 8.
    "long": CBSettings(page_size=256, num_blocks=50, max_batch_tokens=2304, max_requests_per_batch=2),
    # 60-token pages: 300 = 5 x 60, so the whole system prompt is shared. Timed on its first 32 requests:
    # 302 and 258 s as here (two runs); 512 and 2,048 tokens a step 263 and 261/288 s, 8 and 32 requests 314 and
    # 298 s: nothing beat it by more than the 17% the same setting moved between runs.
    "chat": CBSettings(page_size=60, num_blocks=240, max_batch_tokens=1024, max_requests_per_batch=16),
}


def cb_settings_to_fit(work, page_size: int = 64, requests_per_batch: int = 16) -> CBSettings:
    """Sizes transformers' cache to the work, as CB_SETTINGS do: left to itself on the CPU, transformers sizes
    its cache from the host's free memory and zeroes gigabytes before the first step (minutes on 2 cores)."""
    longest = max(len(p) + n for p, n in work)
    per_request = -(-longest // page_size)
    step = min(len(work), requests_per_batch)
    return CBSettings(
        page_size=page_size,
        num_blocks=per_request * step + -(-per_request * step // 4),  # a quarter to spare, as the presets
        max_batch_tokens=2048,
        max_requests_per_batch=step,
    )


def add_parser(sub) -> None:
    p = sub.add_parser("offline", help="offline throughput against transformers")
    p.add_argument(
        "--workload",
        default="default",
        help=f"{', '.join(PRESETS)}, a comma list of them, or all: each in turn, then one table (default: default)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        help="requests of each workload run (default: the preset's: "
        f"{', '.join(f'{w.name} {w.num_prompts}' for w in PRESETS.values())})",
    )
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        help="prompt lengths, uniform: the default workload only (its default: 32 512); refused with another",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        help="output lengths, uniform: the default workload only (its default: 32 256); refused with another",
    )
    p.add_argument(
        "--peers",
        help="comma list of: cb, generate, vllm (or none); default: cb,generate for one workload, cb for several",
    )
    p.add_argument(
        "--vllm-dtype",
        default="bfloat16,float32",
        help="--peers vllm: the dtypes vLLM runs in, each a row (default: bfloat16,float32)",
    )
    p.add_argument("--generate-batch", type=int, default=16)
    p.add_argument("--output", default="bench_results/offline.json")
    EngineArgs.add_cli_args(p)  # its --seed seeds the workload too
    p.set_defaults(func=run)


def chosen_workloads(ns) -> list[Workload]:
    """The --workload presets, with --num-prompts, --input-len and --output-len applied."""
    names = list(PRESETS) if ns.workload == "all" else [w for w in ns.workload.split(",") if w]
    if not names or set(names) - set(PRESETS):
        raise ValueError(f"--workload takes {', '.join(PRESETS)}, a comma list of them, or all; got {ns.workload!r}")
    if (ns.input_len or ns.output_len) and names != ["default"]:
        raise ValueError(f"--input-len and --output-len shape the default workload only; got --workload {ns.workload}")
    return [
        dataclasses.replace(
            PRESETS[n],
            num_prompts=ns.num_prompts or PRESETS[n].num_prompts,
            input_len=tuple(ns.input_len or PRESETS[n].input_len),
            output_len=tuple(ns.output_len or PRESETS[n].output_len),
        )
        for n in names
    ]


def chosen_peers(ns, num_workloads: int) -> list[str]:
    # Across workloads only continuous batching, the peer the goal is set against: plain generate is slow.
    given = ns.peers if ns.peers is not None else "cb,generate" if num_workloads == 1 else "cb"
    peers = [p for p in given.split(",") if p and p != "none"]
    if set(peers) - set(PEERS):
        raise ValueError(f"--peers takes {', '.join(PEERS)} or none; got {given!r}")
    return peers


def served_quantization(model) -> str:
    """The --quantization the model's linear layers were built with: the
    module of their method (gguf, int8, fp8, compressed_tensors), or none."""
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        kind = type(method).__module__.rsplit(".", 1)[-1] if method is not None else "unquantized"
        if kind != "unquantized":
            return kind.replace("_", "-")
    return "none"


def model_params(model) -> int:
    """The model's weights, counted as numbers (a GGUF matrix's blocks hold rows x columns of them)."""
    n = 0
    for p in model.parameters():
        groups = getattr(p, "gguf_groups", None)
        n += sum(d.shape[0] * cols for _, d, cols in groups) if groups else p.numel()
    return n


def run_shoal(args: EngineArgs, work) -> dict:
    from shoal.workers import LLM, SamplingParams
    from shoal.workers.model_executor.platforms.cpu.precision import compute_dtype

    llm = LLM(**dataclasses.asdict(args))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:2]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (one prompt or two)
    eng = llm.engine
    model = eng.runner.model
    moe = hasattr(model, "expert_load")  # a mixture of experts: count the timed run's routing alone
    if moe:
        model.reset_expert_load()
    steps0, step_s0 = eng.num_steps, eng.step_seconds
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [n for _, n in work]
    stats = eng.stats()
    steps = eng.num_steps - steps0
    # Parameters of the whole model (each rank holds 1/K of most of them).
    params = model_params(eng.runner.model) if args.tensor_parallel_size == 1 else None
    result = {
        "seconds": dt,
        "preemptions": stats.num_preemptions,
        "load_s": eng.load_time_s,
        "steps": steps,
        "step_ms": 1000 * (eng.step_seconds - step_s0) / max(steps, 1),
        "params": params,
        "tensor_parallel_size": eng.args.tensor_parallel_size,
        "outputs": [o.token_ids for o in outs],
        "quantization": served_quantization(model),
        # What its matmuls multiplied in (bfloat16 only where the CPU computes it so): picks the roofline.
        "compute_dtype": compute_dtype(model),
    }
    if moe:
        # Rank 0 routes every token (the router is replicated), so its counts are the group's.
        result["expert_load"] = model.expert_load().tolist()  # [sparse layer][expert]
        result["rank_load"] = model.rank_load().tolist()  # [sparse layer][expert-parallel rank]
        if params is not None:  # a token passes through top_k of each layer's experts
            cfg = model.config
            experts = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in model.moe_layers())
            result["active_params"] = params - round(experts * (1 - cfg.num_experts_per_tok / cfg.num_experts))
    llm.shutdown()
    return result


def hf_model(path: str, dtype, random_weights: bool = False):
    """transformers' model of an HF folder or a GGUF file, for comparison. Attention is sdpa, which its
    continuous batching runs on a paged cache as is (this version deprecates the `paged|sdpa` spelling).
    random_weights (--load-format dummy): built from the folder's config.json alone, as shoal's is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights and os.path.isdir(path):
        config = AutoConfig.from_pretrained(path)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()

    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype, attn_implementation="sdpa"
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def run_hf_cb(model, work, settings: CBSettings | None = None) -> dict:
    """transformers' continuous batching; settings None leaves its sizes to transformers (from free memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(**dataclasses.asdict(settings)) if settings else ContinuousBatchingConfig()
    with model.continuous_batching_context_manager(
        generation_config=gc, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        # As run_shoal: the cache's allocation and a 4-token warm-up on the first two prompts are not timed.
        _finish(manager, {f"w{i}": (p, 4) for i, (p, _) in enumerate(work[:2])})
        t0 = time.perf_counter()
        got = _finish(manager, {f"r{i}": (p, n) for i, (p, n) in enumerate(work)})
        dt = time.perf_counter() - t0
        stated = cb_stated(manager)
    assert got == {f"r{i}": n for i, (_, n) in enumerate(work)}, "a request got the wrong number of tokens"
    return {"seconds": dt, "settings": stated}


def _finish(manager, requests: dict[str, tuple[list[int], int]]) -> dict[str, int]:
    """Submits the requests (id: prompt, max_new_tokens) and waits for all; returns id: tokens generated."""
    for rid, (ids, n) in requests.items():
        manager.add_request(ids, request_id=rid, max_new_tokens=n, eos_token_id=-1)
    got = {}
    while len(got) < len(requests):
        res = manager.get_result(timeout=1)
        if res is not None and res.is_finished():
            got[res.request_id] = len(res.generated_tokens)
        elif res is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching loop stopped")
    return got


def cb_stated(manager) -> dict:
    """The settings transformers runs with, read back: the warm-up at the context's entry built the cache,
    so sizes it would infer are concrete by now."""
    cfg = manager.continuous_batching_config
    # None where this transformers names a field otherwise (5.17 has no page_size).
    stated = {f.name: getattr(cfg, f.name, None) for f in dataclasses.fields(CBSettings)}
    return stated | {"attn_implementation": manager.model.config._attn_implementation}


def describe_cb(st: dict) -> str:
    return (
        f"{st['attn_implementation']}, {st['scheduler_type']}, {st['num_blocks']} pages of {st['page_size']}, "
        f"{st['max_batch_tokens']} tokens and {st['max_requests_per_batch']} requests a step"
        + (", prefix sharing" if st["allow_block_sharing"] else "")
    )


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
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(n for _, n in chunk),
                min_new_tokens=max(n for _, n in chunk),
                eos_token_id=None,
                pad_token_id=0,
            )
    return {"seconds": time.perf_counter() - t0}


@dataclass
class Bench:
    """What every workload of one run shares."""

    args: EngineArgs
    vocab: int
    peak: float  # the matmul rate, measured once per run
    peers: list[str]
    generate_batch: int
    int8_peak: float | None = None  # the integer dot-product rate, measured under --quantization gguf
    rooflines: dict | None = None  # each arithmetic's peak (roofline.py), measured once per run
    vllm_dtypes: list[str] = dataclasses.field(default_factory=list)  # --peers vllm: a row each
    log_dir: str = "bench_results"  # where the vLLM peer's logs go

    @property
    def peer_dtype(self) -> str:
        """What the transformers peers compute in: the dtype shoal resolved."""
        return str(self.args.resolved_dtype(self.args.resolved_device())).removeprefix("torch.")

    @functools.cached_property
    def peer_model(self):
        """transformers' model, loaded once, after shoal's first run, for every workload's peers. The peers
        compute in the dtype shoal resolved, so the comparison stays like for like."""
        from shoal.workers.model_executor.loader.model_loader import resolve_model

        args = self.args
        return hf_model(
            resolve_model(args.model), args.resolved_dtype(args.resolved_device()), args.load_format == "dummy"
        )

    @functools.cached_property
    def vllm_peer(self):
        """vLLM's CPU build (installed on first use) on the model written as an HF folder."""
        from shoal.workers.model_executor.loader.model_loader import load_model_files

        cfg = load_model_files(self.args.model).config
        return vllm_peer.OfflinePeer.prepare(self.args.model, cfg, self.vllm_dtypes, self.args.seed, self.log_dir)

    def run_workload(self, w: Workload) -> dict:
        """Shoal, then the peers, on one workload; prints its table and returns its report."""
        args = self.args
        work = make_workload(w.num_prompts, args.seed, w.input_len, w.output_len, self.vocab, w.shared_prefix)
        n_in, n_out = sum(len(p) for p, _ in work), sum(n for _, n in work)
        print(
            f"\nworkload {w.name}: {len(work)} requests, {n_in} prompt tokens, {n_out} output tokens "
            f"(seed {args.seed})",
            flush=True,
        )
        results = self.run_shoals(work)
        first = next(iter(results.values()))
        params = first.get("active_params") or first["params"]  # a MoE's: what one token multiplies by
        if "cb" in self.peers:
            r = results[CB] = run_hf_cb(self.peer_model, work, CB_SETTINGS[w.name])
            print(f"transformers CB: {r['seconds']:.1f} s ({describe_cb(r['settings'])})", flush=True)
        if "generate" in self.peers:
            key = f"transformers generate (batches of {self.generate_batch})"
            results[key] = run_hf_generate(self.peer_model, work, self.generate_batch)
            print(f"{key}: {results[key]['seconds']:.1f} s", flush=True)
        if "vllm" in self.peers:
            results.update(self.vllm_peer.run(work, w.name))
        flops = 2 * params * (n_in + n_out)
        for r in results.values():
            r["output_tok_s"] = n_out / r["seconds"]
            if "quantization" not in r:  # transformers' peers
                r.setdefault("compute_dtype", self.peer_dtype)
            # its share of the peak of the arithmetic it multiplied in (roofline.py)
            r["roofline"] = roofline_share(r, flops, self.rooflines or {})
            r["roofline_fraction"] = r["roofline"]["fraction"]
        print_table(results)
        print(
            f"\nroofline: 2 x {params / 1e6:.1f}M {'active ' if 'active_params' in first else ''}params x "
            f"{n_in + n_out} tokens = {flops / 1e12:.2f} TOP"
        )
        for r in {r["roofline"]["against"]: r["roofline"] for r in results.values()}.values():
            if r["peak_ops_s"]:
                print(
                    f"  at the {r['against']} peak, {r['peak_ops_s'] / 1e9:.1f} GOP/s ({r['instruction']}): "
                    f"{flops / r['peak_ops_s']:.1f} s"
                )
        shape = dataclasses.asdict(w) | {"seed": args.seed, "prompt_tokens": n_in, "output_tokens": n_out}
        report = {"workload": shape, "params": params, "results": results}
        if CB in results:
            report["shoal_vs_cb"] = results[CB]["seconds"] / next(iter(results.values()))["seconds"]
        return report

    def same_precision_args(self, first: dict) -> list[tuple[str, EngineArgs]]:
        """--peers vllm: shoal again, unquantized, at each precision vLLM runs in
        (those its own run did not use), so each system is shown at its best
        precision and at the same one, side by side."""
        args = self.args
        if "vllm" not in self.peers or args.tensor_parallel_size > 1:
            return []
        own = str(args.resolved_dtype(args.resolved_device())).removeprefix("torch.")
        return [
            (f"shoal {dtype}", dataclasses.replace(args, quantization="none", dtype=dtype))
            for dtype in self.vllm_dtypes
            if (first["quantization"], own) != ("none", dtype)
        ]

    def run_shoals(self, work) -> dict[str, dict]:
        """Shoal's results, its run at --tensor-parallel-size first (and with K > 1 its run at K = 1;
        with --peers vllm its runs at vLLM's precisions)."""
        args, tp = self.args, self.args.tensor_parallel_size
        results = {}
        if tp > 1:
            one = run_shoal(dataclasses.replace(args, tensor_parallel_size=1), work)
            print(f"shoal K=1: {one['seconds']:.1f} s, {one['step_ms']:.1f} ms/step", flush=True)
        s = run_shoal(args, work)
        results["shoal" if tp == 1 else f"shoal K={tp}"] = s
        print(
            f"shoal{'' if tp == 1 else f' K={tp}'}: {s['seconds']:.1f} s, {s['step_ms']:.1f} ms/step "
            f"({s['preemptions']} preemptions)",
            flush=True,
        )
        if "expert_load" in s:
            print_expert_load(s)
        for label, same in self.same_precision_args(s):
            results[label] = r = run_shoal(same, work)
            print(f"{label}: {r['seconds']:.1f} s, {r['step_ms']:.1f} ms/step", flush=True)
        if tp > 1:
            results["shoal K=1"] = one
            s["same_tokens_as_k1"] = s["outputs"] == one["outputs"]
            s["params"] = one["params"]
            if "active_params" in one:
                s["active_params"] = one["active_params"]
            print(
                f"K={tp} step time is {s['step_ms'] / one['step_ms']:.2f}x K=1's on these {os.cpu_count()} "
                f"cores (all-reduce over gloo); same tokens as K=1: {s['same_tokens_as_k1']}"
            )
        for r in results.values():
            r.pop("outputs")
        return results


def print_expert_load(r: dict) -> None:
    """A MoE run's routing: (token, expert) picks per expert summed over the sparse layers, the busiest
    expert against the mean (1.00 = even), and, under expert parallelism, each rank's share."""
    layers = r["expert_load"]
    per_expert = [sum(col) for col in zip(*layers)]
    mean = sum(per_expert) / len(per_expert)
    worst = max(max(row) / (sum(row) / len(row)) for row in layers)
    print(
        f"expert load over {len(layers)} sparse layers: {sum(per_expert)} picks, busiest expert "
        f"{max(per_expert) / mean:.2f}x the mean (worst single layer {worst:.2f}x)"
    )
    print("  per expert: " + " ".join(str(n) for n in per_expert))
    ranks = [sum(col) for col in zip(*r["rank_load"])]
    if len(ranks) > 1:
        total = sum(ranks)
        shares = ", ".join(f"{i}: {n} ({100 * n / total:.1f}%)" for i, n in enumerate(ranks))
        print(f"  per expert-parallel rank: {shares}")


def print_table(results: dict[str, dict]) -> None:
    """One workload's engines, against the first (shoal)."""
    base = next(iter(results.values()))["seconds"]
    first = next(iter(results))
    print()
    print(
        f"{'engine':<40} {'seconds':>8} {'out tok/s':>10} {first + ' is':>12} {'ms/step':>8}  "
        "% of its arithmetic's roofline"
    )
    for name, r in results.items():
        step = f"{r['step_ms']:>8.1f}" if "step_ms" in r else f"{'':>8}"
        print(
            f"{name:<40} {r['seconds']:>8.1f} {r['output_tok_s']:>10.1f} {r['seconds'] / base:>11.2f}x "
            f"{step}  {format_share(r['roofline'])}"
        )


def print_summary(reports: dict[str, dict]) -> None:
    """One row a workload: shoal against transformers' continuous batching, with the settings it ran."""
    print(
        f"\n{'workload':<10} {'requests':>8} {'shoal s':>8} {'out tok/s':>10} {'CB s':>8} {'shoal vs CB':>11} "
        f"{'% of roofline':>22}  transformers CB settings"
    )
    for name, rep in reports.items():
        s, cb = next(iter(rep["results"].values())), rep["results"].get(CB)
        peer = f"{cb['seconds']:>8.1f} {rep['shoal_vs_cb']:>10.2f}x" if cb else f"{'-':>8} {'-':>11}"
        stated = describe_cb(cb["settings"]) if cb else "-"
        print(
            f"{name:<10} {rep['workload']['num_prompts']:>8} {s['seconds']:>8.1f} {s['output_tok_s']:>10.1f} "
            f"{peer} {format_share(s['roofline']):>22}  {stated}"
        )


def run(ns) -> int:
    import torch

    from shoal.workers.model_executor.loader.model_loader import load_model_files

    workloads = chosen_workloads(ns)
    peers = chosen_peers(ns, len(workloads))
    vllm_dtypes = vllm_peer.parse_dtypes(ns.vllm_dtype) if "vllm" in peers else []
    args = EngineArgs.from_cli_args(ns)
    cfg = load_model_files(args.model).config
    cfg.check_tp_size(args.tensor_parallel_size, args.enable_expert_parallel)  # before anything runs
    # Each arithmetic's peak, the real GEMMs' rates beside them (the Q8_0 kernel's under an integer
    # quantization); every run's share is of the peak of its arithmetic.
    threads = args.num_threads or torch.get_num_threads()
    gemms = measure_gemms(threads, int8=args.quantization in (*INTEGER_METHODS, "auto"))
    peak, int8_peak = gemms["float32"]["wall_ops_s"], gemms.get("int8", {}).get("wall_ops_s")
    rooflines = measure_rooflines(threads, achieved=gemms)
    print(format_rooflines(rooflines), flush=True)
    bench = Bench(args, cfg.vocab_size, peak, peers, ns.generate_batch, int8_peak, rooflines=rooflines)
    if "vllm" in peers:  # installed (first use) and the model written before anything is timed
        bench.vllm_dtypes, bench.log_dir = vllm_dtypes, os.path.dirname(ns.output) or "."
        bench.vllm_peer  # noqa: B018
    reports = {w.name: bench.run_workload(w) for w in workloads}
    if len(reports) > 1:
        print_summary(reports)
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(
            {"matmul_flops": peak, "int8_dot_ops": int8_peak, "rooflines": rooflines, "workloads": reports}, f, indent=2
        )
    print(f"wrote {ns.output}")
    return 0
