"""How fast the GGUF block kernel (csrc/gguf_gemv.cpp, gguf_linear) multiplies one row of
activations by weights kept in llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks (packed by gguf_pack in
groups of 16 rows, as the model holds them), next to the float32 matmul of the decode step
(small_m_linear) on the same weights dequantized.

At one row a linear layer is a read of its weights: the figures are GB/s of weight bytes read
(the blocks' bytes for gguf_linear, 4 bytes a weight for float32) and the speedup over float32
in time per call, which at one row is the speedup in tokens a second of the layer. Shapes:
SmolLM2-135M's MLP (hidden 576, intermediate 1536): gate_up (N=3072, K=576) and down
(N=576, K=1536). Each case rotates over enough weight copies (256 MB) that they come from
memory, not the L3; medians of repeated calls, the cases taking turns round by round.

The K-quants (csrc/gguf_kquants.cpp, gguf_linear_k: Q4_K / Q5_K / Q6_K) need K a multiple of
256, which SmolLM2-135M's 576 is not: they run on TinyLlama-1.1B's MLP shapes (hidden 2048,
intermediate 5632), at M=1 (decode) and M=64 (a prefill chunk), against float32 small_m_linear
on the Q4_K weights dequantized. gguf cannot quantize the K types: the blocks are random quants
with valid fp16 scales (the speed does not depend on the values).

Then batched rows (--rows, default 16, 64, 256, 512: prefill chunks and large decode batches) on
SmolLM2-135M's shapes, K = 576 and N = 576 (q, o), 192 (k, v), 1536 (gate, up), 49152 (the LM
head), and its down projection (1536->576): gguf_linear on the packed groups (tiles of 16 weight
rows x 4 rows of x) against the same one row of x at a time (set_gguf_gemm_min_rows) and float32
F.linear (MKL) on the same weights dequantized; GOP/s (2 M N K a call: int8 multiply-adds for the
blocks, float32 ones for F.linear) and time per call. The weights stay in cache here (but the LM
head's 18-28 MB): at these rows a layer is compute-bound.

`python -m shoal.benchmarks.gguf_kernels [--rounds 200] [--threads N] [--rows 16,64,256,512]`"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from shoal.benchmarks.moe_kernel import time_alternating
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

_ROTATE_BYTES = 256 << 20
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}
PREFILL_SHAPES = {
    "576->576": (576, 576),
    "576->192": (192, 576),
    "576->1536": (1536, 576),
    "1536->576": (576, 1536),
    "576->49152": (49152, 576),
}
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
K_SHAPES = {"gate_up": (11264, 2048), "down": (2048, 5632)}
K_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def _copies(one: torch.Tensor) -> list[torch.Tensor]:
    n = max(2, -(-_ROTATE_BYTES // (one.numel() * one.element_size())))
    return [one.clone() for _ in range(n)]


def _kquant_blocks(N: int, K: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks [N, K / 256 * block bytes] with fp16 d (and dmin) of a weight's size."""
    bb = GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (N, K // 256, bb), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, (N, K // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        b[..., 208:210] = d[..., :2]
    else:
        b[..., 0:4] = d
    return b.reshape(N, -1)


def _bench_kquants(kernel, rounds: int) -> None:
    print(f"K-quants, TinyLlama-1.1B MLP shapes, weights rotated over {_ROTATE_BYTES >> 20} MB a case")
    print(
        f"{'shape':<8} {'M':>3} {'N':>6} {'K':>5} {'weights':<8} {'bytes':>9} {'us/call':>9} {'GB/s':>7} {'vs f32':>7}"
    )
    rng = np.random.default_rng(0)
    for name, (N, K) in K_SHAPES.items():
        blocks = {q: _kquant_blocks(N, K, q, rng) for q in K_TYPES}
        ws = {q.name: _copies(torch.from_numpy(b)) for q, b in blocks.items()}
        wf = _copies(torch.from_numpy(dequantize(blocks[K_TYPES[0]], K_TYPES[0])))
        for M in (1, 64):
            x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
            cases: dict[str, Callable[[int], object]] = {
                q.name: lambda i, x=x, w=ws[q.name], t=int(q): kernel.gguf_linear_k(x, w[i % len(w)], t, False)
                for q in K_TYPES
            }
            cases["f32"] = lambda i, x=x, wf=wf: kernel.small_m_linear(x, wf[i % len(wf)], None)
            nbytes = {q.name: blocks[q].nbytes for q in K_TYPES} | {"f32": N * K * 4}
            t = time_alternating(cases, rounds)
            for case in [*nbytes]:
                print(
                    f"{name:<8} {M:>3} {N:>6} {K:>5} {case:<8} {nbytes[case]:>9} {t[case] * 1e6:>9.1f} "
                    f"{nbytes[case] / t[case] / 1e9:>7.2f} {t['f32'] / t[case]:>6.2f}x"
                )
        del ws, wf


def _prefill(kernel, rows: list[int], rounds: int, rng: np.random.Generator) -> None:
    """The tiles of 4 rows of x against one row at a time and F.linear at prefill rows; the weights
    stay in cache."""
    print(f"\nbatched rows, threads {torch.get_num_threads()}: GOP/s = 2 M N K / time; x faster than f32, 1-row")
    print(f"{'shape':<10} {'M':>4} {'case':<10} {'us/call':>9} {'GOP/s':>8} {'vs f32':>7} {'vs 1-row':>8}")
    for name, (N, K) in PREFILL_SHAPES.items():
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        blocks = {q.name: kernel.gguf_pack(torch.from_numpy(quantize(w, q)), int(q)) for q in TYPES}
        wf = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1))
        for M in rows:
            x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
            cases: dict[str, Callable[[int], object]] = {"f32": lambda i, x=x, wf=wf: F.linear(x, wf)}
            for qtype in TYPES:
                b, t = blocks[qtype.name], int(qtype)
                cases[qtype.name] = lambda i, x=x, b=b, t=t: kernel.gguf_linear(x, b, t, False)
                cases[f"{qtype.name} 1-row"] = lambda i, x=x, b=b, t=t: _one_row(kernel, x, b, t)
            times = time_alternating(cases, max(3 if N > 4096 else 10, min(rounds, rounds * 16 // M * 576 // N)))
            for case, sec in times.items():
                tiles = times.get(f"{case} 1-row")
                print(
                    f"{name:<10} {M:>4} {case:<10} {sec * 1e6:>9.1f} {2 * M * N * K / sec / 1e9:>8.1f} "
                    f"{times['f32'] / sec:>6.2f}x " + (f"{tiles / sec:>7.2f}x" if tiles else "")
                )


def _one_row(kernel, x: torch.Tensor, b: torch.Tensor, t: int) -> torch.Tensor:
    """gguf_linear one row of x at a time over each packed group (the decode path), whatever the
    rows: what the tiles of 4 rows of x save."""
    old = kernel.set_gguf_gemm_min_rows(1 << 30)
    try:
        return kernel.gguf_linear(x, b, t, False)
    finally:
        kernel.set_gguf_gemm_min_rows(old)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", default="16,64,256,512", help="prefill rows, comma-separated ('' for none)")
    parser.add_argument("--only-k", action="store_true", help="only the K-quants (gguf_linear_k)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = cpu_kernels.load()
    if kernel is None or not kernel.has_avx2:
        raise SystemExit("the CPU kernels did not build with AVX2")
    if args.only_k:
        print(f"threads {torch.get_num_threads()}")
        return _bench_kquants(kernel, args.rounds)
    print(f"threads {torch.get_num_threads()}, M=1, weights rotated over {_ROTATE_BYTES >> 20} MB a case")
    print(f"{'shape':<8} {'N':>5} {'K':>5} {'weights':<8} {'bytes':>9} {'us/call':>9} {'GB/s':>7} {'vs f32':>7}")
    rng = np.random.default_rng(0)
    for name, (N, K) in SHAPES.items():
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        x = torch.from_numpy(rng.standard_normal((1, K)).astype(np.float32))
        cases: dict[str, Callable[[int], object]] = {}
        nbytes: dict[str, int] = {}
        for qtype in TYPES:
            blocks = quantize(w, qtype)
            ws = _copies(kernel.gguf_pack(torch.from_numpy(blocks), int(qtype)))
            cases[qtype.name] = lambda i, x=x, ws=ws, t=int(qtype): kernel.gguf_linear(x, ws[i % len(ws)], t, False)
            nbytes[qtype.name] = blocks.nbytes
        # float32: the Q4_1 weights dequantized (the same values the default model's layers hold).
        wf = _copies(torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)))
        cases["f32"] = lambda i, x=x, wf=wf: kernel.small_m_linear(x, wf[i % len(wf)], None)
        nbytes["f32"] = N * K * 4
        t = time_alternating(cases, args.rounds)
        for case in [*[q.name for q in TYPES], "f32"]:
            print(
                f"{name:<8} {N:>5} {K:>5} {case:<8} {nbytes[case]:>9} {t[case] * 1e6:>9.1f} "
                f"{nbytes[case] / t[case] / 1e9:>7.2f} {t['f32'] / t[case]:>6.2f}x"
            )
        del cases, wf
    rows = [int(r) for r in args.rows.split(",") if r]
    if rows:
        _prefill(kernel, rows, args.rounds, rng)
    _bench_kquants(kernel, args.rounds)


if __name__ == "__main__":
    main()
