"""How fast the GGUF block kernel (csrc/gguf_gemv.cpp, gguf_linear) multiplies one row of
activations by weights kept in llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks, next to the float32
matmul of the decode step (small_m_linear) on the same weights dequantized.

At one row a linear layer is a read of its weights: the figures are GB/s of weight bytes read
(the blocks' bytes for gguf_linear, 4 bytes a weight for float32) and the speedup over float32
in time per call, which at one row is the speedup in tokens a second of the layer. Shapes:
SmolLM2-135M's MLP (hidden 576, intermediate 1536): gate_up (N=3072, K=576) and down
(N=576, K=1536). Each case rotates over enough weight copies (256 MB) that they come from
memory, not the L3; medians of repeated calls, the cases taking turns round by round.

`python -m shoal.benchmarks.gguf_kernels [--rounds 200] [--threads N]`"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from shoal.benchmarks.moe_kernel import time_alternating
from shoal.workers.model_executor.layers import cpu_kernels

_ROTATE_BYTES = 256 << 20
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _copies(one: torch.Tensor) -> list[torch.Tensor]:
    n = max(2, -(-_ROTATE_BYTES // (one.numel() * one.element_size())))
    return [one.clone() for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = cpu_kernels.load()
    if kernel is None or not kernel.has_avx2:
        raise SystemExit("the CPU kernels did not build with AVX2")
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
            ws = _copies(torch.from_numpy(blocks))
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


if __name__ == "__main__":
    main()
