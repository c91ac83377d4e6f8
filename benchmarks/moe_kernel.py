"""How fast the CPU fused-MoE path reads expert weights at decode, next to a
dense SwiGLU MLP of the same bytes through the same compiled matmul
(platforms/cpu/matmul.py).

A decode step's MoE layer multiplies a few rows by the weights of each
expert its tokens picked: a read of those experts' weights, split into one
small matmul per expert over the rows routed to it (batch x top_k / experts
hit, on average). Two dense figures go next to it: the same bytes in two
large matmuls over that many rows (the same work per byte: the ratio is
what the per-expert split costs), and over the batch's rows (what a dense
layer of the same step reaches; more rows, more work per byte).
Shape: a Qwen3-MoE-like layer (hidden 1024, expert intermediate 768, 32
experts, top 4), weights stored in bfloat16, activations float32; random
routing, fresh each call. Every case rotates over enough weights that they
come from memory, not the 32 MB L3. Medians of repeated calls, the MoE
layer and its same-work dense MLP taking turns (a busy machine slows both
alike); the figures are still only as steady as the machine is idle.

`python -m shoal.benchmarks.moe_kernel [--batches 1 16 64] [--threads 1]`"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.workers.model_executor.layers.fused_moe import fused_experts, select_experts
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels
from shoal.workers.model_executor.platforms.cpu.matmul import linear

# At least this many weight bytes are cycled through, several times any L3 cache.
_ROTATE_BYTES = 400 << 20


def time_alternating(cases: dict[str, Callable[[int], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each case (called with the round's index), the cases taking
    turns round by round so that a busy machine slows them alike; after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(-1, rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn(i)
            if i >= 0:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _dense_mlp(rows: int, hidden: int, inter: int, weight_dtype: torch.dtype, kernel, gen: torch.Generator):
    """(call(i), weight bytes a call): a dense SwiGLU MLP (hidden -> inter -> hidden) over `rows`
    rows, call i taking the i-th of enough weight copies to come from memory."""
    x = torch.randn(rows, hidden, generator=gen)
    one = (3 * inter * hidden) * torch.empty((), dtype=weight_dtype).element_size()
    mlps = [
        (
            (torch.randn(2 * inter, hidden, generator=gen) * 0.03).to(weight_dtype),
            (torch.randn(hidden, inter, generator=gen) * 0.03).to(weight_dtype),
        )
        for _ in range(max(2, -(-_ROTATE_BYTES // one)))
    ]

    def call(i: int) -> torch.Tensor:
        gate_up, down = mlps[i % len(mlps)]
        h = linear(x, gate_up, None, kernel)
        h = kernel.silu_and_mul(h) if kernel is not None else F.silu(h[:, :inter]) * h[:, inter:]
        return linear(h, down, None, kernel)

    return call, one


def measure(
    batch: int,
    kernel,
    hidden: int = 1024,
    inter: int = 768,
    num_experts: int = 32,
    top_k: int = 4,
    weight_dtype: torch.dtype = torch.bfloat16,
    rounds: int = 40,
) -> dict[str, float]:
    """The MoE layer's weight read rate at `batch` rows, and a dense MLP's of the same bytes
    (intermediate = experts hit x the experts' one) over as many rows as an expert gets on
    average (the same work per byte) and over `batch` rows (a dense layer of the same step)."""
    gen = torch.Generator().manual_seed(batch)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.03).to(weight_dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.03).to(weight_dtype)
    x = torch.randn(batch, hidden, generator=gen)
    routings = [select_experts(torch.randn(batch, num_experts, generator=gen), top_k, True) for _ in range(rounds)]
    hit = statistics.mean(len(ids.unique()) for _, ids in routings)
    moe_bytes = hit * (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def moe(i: int) -> torch.Tensor:
        weights, ids = routings[i % rounds]
        return fused_experts(x, w13, w2, weights, ids, cpu_kernels=kernel)

    rows = max(1, round(batch * top_k / hit))
    dense_inter = round(hit * inter / 16) * 16
    dense, dense_bytes = _dense_mlp(rows, hidden, dense_inter, weight_dtype, kernel, gen)
    t = time_alternating({"moe": moe, "dense": dense}, rounds)
    dense_batch, _ = _dense_mlp(batch, hidden, dense_inter, weight_dtype, kernel, gen)
    t.update(time_alternating({"dense_batch": dense_batch}, max(4, rounds // 8)))
    return {
        "experts_hit": hit,
        "rows_per_expert": rows,
        "moe_ms": t["moe"] * 1e3,
        "moe_gbps": moe_bytes / t["moe"] / 1e9,
        "dense_gbps": dense_bytes / t["dense"] / 1e9,
        "dense_batch_gbps": dense_bytes / t["dense_batch"] / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--weight-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--no-cpu-kernels", action="store_true", help="the torch path (MKL) instead of csrc/cpu_gemm.cpp")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernel = None if args.no_cpu_kernels else cpu_kernels.load()
    if kernel is not None and not getattr(kernel, "has_avx2", False):
        kernel = None
    dtype = getattr(torch, args.weight_dtype)
    print(f"{args.weight_dtype} weights, {args.threads} threads, {'compiled matmul' if kernel else 'torch matmul'}")
    print("batch  experts hit  rows/expert  MoE ms  MoE GB/s  dense GB/s (rows/expert, ratio)  (batch rows, ratio)")
    for batch in args.batches:
        r = measure(batch, kernel, weight_dtype=dtype)
        print(
            f"{batch:>5} {r['experts_hit']:>12.1f} {r['rows_per_expert']:>12} {r['moe_ms']:>7.2f} {r['moe_gbps']:>9.1f}"
            f" {r['dense_gbps']:>14.1f} {r['moe_gbps'] / r['dense_gbps']:>19.0%}"
            f" {r['dense_batch_gbps']:>8.1f} {r['moe_gbps'] / r['dense_batch_gbps']:>10.0%}"
        )


if __name__ == "__main__":
    main()
