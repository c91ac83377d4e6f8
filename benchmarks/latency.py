"""`shoal bench latency`, like vLLM's: one request at a time (a prompt of
--input-len random tokens, --output-len tokens out, ignore_eos), repeated,
with the time to first token and the time per output token (p50/p99), and
the memory floor of a decode step: the model's weight bytes over the read
bandwidth this bench measures on this machine (a large tensor's sum on the
engine's threads, best of several). A decode step at batch 1 reads every
weight once, so it cannot beat that floor; the ratio says how far off it is.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

from shoal.workers.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="one request at a time: TTFT and per-token time against the memory floor")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--read-mib", type=int, default=512, help="size of the tensor the read bandwidth is measured on")
    p.add_argument("--profile", action="store_true",
                   help="then profile one more request's decode steps (torch.profiler) and print where a step goes")
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
    """Bytes of the model's weights, each storage once (tied weights are one;
    buffers such as rotary tables are left out: a step reads a few rows)."""
    seen, total = set(), 0
    for t in model.parameters():
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(engine, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    """(TTFT s, the gaps between the request's later tokens in s)."""
    from shoal.workers import SamplingParams

    rid = f"latency-{time.perf_counter_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times.extend([time.perf_counter()] * len(out.new_token_ids))
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def run(ns) -> int:
    from shoal.workers import LLMEngine

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
    report = {"model": engine.model_name, "dtype": str(model.dtype), "weight_dtype": str(model.lm_head.weight.dtype),
              "device": str(device),
              "threads": args.num_threads or os.cpu_count(), "input_len": ns.input_len, "output_len": ns.output_len,
              "num_iters": ns.num_iters, "ttft_ms": {"p50": statistics.median(ttfts) * 1e3, "p99": _pct(ttfts, 0.99) * 1e3},
              "tpot_ms": {"p50": tpot50 * 1e3, "p99": tpot99 * 1e3}, "weight_bytes": nbytes,
              "read_bandwidth_gb_s": bw / 1e9, "memory_floor_ms": floor * 1e3, "tpot_over_floor": tpot50 / floor}  # fmt: skip
    print(f"{report['model']} ({report['dtype']}, weights {report['weight_dtype']}, {report['device']}), "
          f"prompt {ns.input_len}, {ns.output_len} out, "
          f"{ns.num_iters} requests after {ns.num_iters_warmup} warm-up")  # fmt: skip
    print(f"  time to first token   p50 {report['ttft_ms']['p50']:8.1f} ms   p99 {report['ttft_ms']['p99']:8.1f} ms")
    print(f"  time per output token p50 {report['tpot_ms']['p50']:8.2f} ms   p99 {report['tpot_ms']['p99']:8.2f} ms"
          f"   ({1 / tpot50:.1f} tok/s)")  # fmt: skip
    print(f"  memory floor          {floor * 1e3:8.2f} ms   ({nbytes / 1e6:.0f} MB of weights / "
          f"{bw / 1e9:.1f} GB/s read)")  # fmt: skip
    print(f"  per-token time / floor {tpot50 / floor:.2f}x")
    if ns.profile:
        report["profile"] = profile(engine, prompts[-1], ns.output_len)
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {ns.output}")
    engine.shutdown()
    return 0


def profile(engine, prompt: list[int], output_len: int, top: int = 12) -> list[dict]:
    """One request under torch.profiler: the ops that took the most time of
    its steps (self time, so nothing is counted twice), printed and returned."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        measure(engine, prompt, output_len)
        wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = wall * 1e6
    out = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total_us} for e in rows[:top]]  # fmt: skip
    print(f"  profile of one request ({wall * 1e3:.0f} ms wall, {output_len} tokens; self time, top {top}):")
    for r in out:
        print(f"    {r['op'][:48]:48} {r['calls']:6d} calls {r['self_ms']:9.2f} ms {100 * r['share']:5.1f}%")
    in_ops = sum(e.self_cpu_time_total for e in rows) / total_us
    print(f"    all ops together: {100 * in_ops:.1f}% of the wall time; the rest is Python between them "
          f"(scheduling, bookkeeping, dispatch) and the profiler's own cost")  # fmt: skip
    return out
