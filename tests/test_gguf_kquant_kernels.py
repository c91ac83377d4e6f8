"""The GGUF K-quant kernels (csrc/gguf_kquants.cpp): weights in llama.cpp's Q4_K / Q5_K / Q6_K
super-blocks of 256, activations quantized per 256 to block_q8_K as llama.cpp does
(quantize_row_q8_K_ref), integer dot products per sub-block with the 6-bit (Q4_K, Q5_K) or
8-bit (Q6_K) scales.

The installed gguf quantizes none of the K types (only dequantizes them), so the weight blocks
are random bytes with valid fp16 scales: every byte pattern of the quants and packed scales is a
valid block. gguf's own dequantizer is the reference for what they mean.

Three references, each for what it can check:
- numpy's block_q8_K of x (the same float32 steps): the kernel's activation blocks byte for byte;
- the same quantized x times the weights' own integers and scales, in float64 (the weight
  integers decoded here are checked against gguf's dequantize first): the kernel's result to
  float32 accumulation error (1e-5 of sum |x| (|d sc q| + |dmin m|)), which is all that is left;
- gguf's dequantized weights times the float x in float64 (no activation quantization): the
  kernel's result within the error the 8-bit activations imply, stated below, and visibly off it.
The scalar path (force_scalar), the AVX2 path and the AVX-512 path (where built) give equal bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]
QK = 256
Q8K_BYTES = 292


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed? a compiler error in the log?)"
    return k


def _isas(kernel) -> list[str]:
    return ["avx2", "avx512"] if kernel.has_avx512 else ["avx2"]


def _run_isa(kernel, isa: str, fn):
    prev = kernel.set_isa(isa)
    try:
        return fn()
    finally:
        kernel.set_isa(prev)


def _x(M: int, K: int, seed: int) -> np.ndarray:
    """Activations with a spread of block magnitudes, one all-zero block (scale 0), a few outliers,
    and a block whose largest magnitude comes twice with both signs (the first one sets the sign)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 4.0, (M, K // QK, 1)).repeat(QK, 1).reshape(
        M, K
    ).astype(np.float32)
    x[0, :QK] = 0.0
    x[M - 1, -1] = 30.0
    if K > QK:
        x[0, QK + 3], x[0, QK + 7] = -50.0, 50.0  # beyond the block's normal values (at most ~4 * 5)
    return x


def _blocks(N: int, K: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random weight blocks [N, K / 256 * block bytes]: random quants and packed scales, fp16 d (and
    dmin) of a realistic size (Q6_K's int8 scales take their whole range, -128 included)."""
    rng = np.random.default_rng(seed)
    bb = GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (N, K // QK, bb), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, (N, K // QK)).astype(np.float16)
    if qtype == GGMLQuantizationType.Q6_K:
        b[..., 208:210] = d[..., None].view(np.uint8)
    else:
        dmin = rng.uniform(2e-4, 2e-3, (N, K // QK)).astype(np.float16)
        b[..., 0:2] = d[..., None].view(np.uint8)
        b[..., 2:4] = dmin[..., None].view(np.uint8)
    return b.reshape(N, -1)


def _q8k_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref in numpy, float32 throughout: per block of 256, max = the
    first value of largest magnitude, iscale = -127 / max, q = min(127, round-half-even(iscale x)),
    d = 1 / iscale (an all-zero block: d = 0, q = 0). Returns (d float32 [M, nb], q int8 [M, nb, 256])."""
    M, K = x.shape
    b = x.reshape(M, K // QK, QK)
    idx = np.abs(b).argmax(-1)  # the first index of the largest |x|, as the strict > scan finds it
    mx = np.take_along_axis(b, idx[..., None], -1)
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, np.float32(1), mx)).astype(np.float32)
        d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    q = np.minimum(127, np.rint(b * iscale)).astype(np.int8)
    return d[..., 0], q


def _q8k_bytes(x: np.ndarray) -> np.ndarray:
    d, q = _q8k_ref(x)
    bsums = q.reshape(*q.shape[:2], 16, 16).astype(np.int16).sum(-1, dtype=np.int16)
    parts = [d[..., None].view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(x.shape[0], -1)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 of packed scales [..., 12] -> (scales, mins) [..., 8] int64."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _weight_ints(blocks: np.ndarray, qtype: GGMLQuantizationType, K: int):
    """(q, sc, m, d, dmin) of K-quant blocks, value = d sc q - dmin m: q, sc, m int64 [N, nb, 256]
    (per value), d, dmin float64 [N, nb]."""
    N = blocks.shape[0]
    b = blocks.reshape(N, K // QK, GGML_QUANT_SIZES[qtype][1])
    if qtype == GGMLQuantizationType.Q6_K:
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        halves = []
        for h in range(2):
            lo, hi, top = (
                ql[..., 64 * h : 64 * h + 32],
                ql[..., 64 * h + 32 : 64 * h + 64],
                qh[..., 32 * h : 32 * h + 32],
            )
            halves += [
                (lo & 0xF) | ((top & 3) << 4),
                (hi & 0xF) | (((top >> 2) & 3) << 4),
                (lo >> 4) | (((top >> 4) & 3) << 4),
                (hi >> 4) | (((top >> 6) & 3) << 4),
            ]
        q = np.concatenate(halves, -1) - 32
        sc = b[..., 192:208].view(np.int8).astype(np.int64).repeat(16, -1)
        d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)
        return q, sc, np.zeros_like(q), d, np.zeros_like(d)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    sc, mn = _scale_min_k4(b[..., 4:16])
    qs = b[..., 48:176] if qtype == GGMLQuantizationType.Q5_K else b[..., 16:144]
    qs = qs.astype(np.int64)
    parts = []
    for j in range(4):
        lo, hi = qs[..., 32 * j : 32 * j + 32] & 0xF, qs[..., 32 * j : 32 * j + 32] >> 4
        if qtype == GGMLQuantizationType.Q5_K:
            qh = b[..., 16:48].astype(np.int64)
            lo, hi = lo | (((qh >> (2 * j)) & 1) << 4), hi | (((qh >> (2 * j + 1)) & 1) << 4)
        parts += [lo, hi]
    return np.concatenate(parts, -1), sc.repeat(32, -1), mn.repeat(32, -1), d, dmin


def _same_quantization_ref(x: np.ndarray, blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What the kernel computes, in float64 from the same integers: per block pair
    d_w d_x sum(sc q y) - dmin_w d_x sum(m y), summed over blocks."""
    K = x.shape[1]
    q, sc, mn, d, dmin = _weight_ints(blocks, qtype, K)
    dx, qx = _q8k_ref(x)
    qx = qx.astype(np.int64)
    isum = np.einsum("nbi,mbi->mnb", sc * q, qx).astype(np.float64)
    msum = np.einsum("nbi,mbi->mnb", mn, qx).astype(np.float64)
    dx = dx.astype(np.float64)
    return np.einsum("mnb,nb,mb->mn", isum, d, dx) - np.einsum("mnb,nb,mb->mn", msum, dmin, dx)


def _activation_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A bound on |kernel - w @ x| [M, N] from the 8-bit activations alone, w the dequantized weights.

    Per element, x is replaced by d q with q = round(iscale x), d = 1 / iscale in float32 (no fp16
    store here: block_q8_K keeps d as a float). |x - d q| <= |d| / 2 (the rounding) + |x| 2^-22
    (iscale x rounded to float32 and d iscale within a few ulp of 1). Times |w| and summed."""
    M, K = x.shape
    d, _ = _q8k_ref(x)
    x64 = np.abs(x.astype(np.float64))
    e = np.abs(d.astype(np.float64)).repeat(QK, -1) / 2 + x64 * 2.0**-22
    return e @ np.abs(w).T


def test_weight_ints_match_gguf_dequantize():
    """The test's own decoding of the blocks (the integers reference 2 uses) is gguf's."""
    for qtype in TYPES:
        K = 512
        blocks = _blocks(5, K, qtype, seed=3)
        q, sc, mn, d, dmin = _weight_ints(blocks, qtype, K)
        ours = (d[..., None] * sc * q - dmin[..., None] * mn).reshape(5, K)
        np.testing.assert_allclose(ours, dequantize(blocks, qtype).astype(np.float64), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("force_scalar", [False, True])
def test_activation_blocks_match_llama_cpp_layout(kernel, force_scalar):
    x = _x(5, 768, seed=1)
    want = _q8k_bytes(x)
    for isa in _isas(kernel):
        got = _run_isa(kernel, isa, lambda: kernel.quantize_q8_k_activations(torch.from_numpy(x), force_scalar))
        assert got.shape == (5, 768 // QK * Q8K_BYTES)
        np.testing.assert_array_equal(got.numpy(), want)
    # the tie block: -50 comes first, so max = -50 and d = 50 / 127 > 0 (the +50 quantizes to +127)
    d = want[0, Q8K_BYTES : Q8K_BYTES + 4].copy().view(np.float32)[0]
    assert d > 0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_gguf_linear_k_matches_llama_cpp_arithmetic(kernel, qtype, M):
    N, K = 37, 768
    x = _x(M, K, seed=M * 1000 + int(qtype))
    blocks = _blocks(N, K, qtype, seed=K + int(qtype))
    assert blocks.shape == (N, K // QK * GGML_QUANT_SIZES[qtype][1])
    xt, wt = torch.from_numpy(x), torch.from_numpy(blocks)

    y_scalar = kernel.gguf_linear_k(xt, wt, int(qtype), True)
    assert y_scalar.shape == (M, N) and y_scalar.dtype == torch.float32
    for isa in _isas(kernel):
        y = _run_isa(kernel, isa, lambda: kernel.gguf_linear_k(xt, wt, int(qtype), False))
        assert torch.equal(y, y_scalar), f"{isa}: every path does the same float operations on the same integers"
    got = y_scalar.numpy().astype(np.float64)

    q, sc, mn, d, dmin = _weight_ints(blocks, qtype, K)
    parts = np.abs(d[..., None] * sc * q) + np.abs(dmin[..., None] * mn)  # what acc and accm add up
    scale = np.abs(x.astype(np.float64)) @ parts.reshape(N, K).T
    # 1. The same 8-bit activations and the weights' integers in float64: only float32 accumulation differs.
    same = _same_quantization_ref(x, blocks, qtype)
    tight = np.abs(got - same) / scale
    assert tight.max() < 1e-5, tight.max()
    # 2. The float x (no activation quantization) in float64: within the bound the 8-bit activations imply...
    w = dequantize(blocks, qtype).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    err = np.abs(got - exact)
    bound = _activation_error_bound(x, w) + 1e-5 * scale
    assert (err <= bound).all(), (err - bound).max()
    # ...and visibly off it: the activations were quantized, while the bound is not loose by orders of magnitude.
    assert (err / scale).max() > 100 * max(tight.max(), 1e-7)
    assert err.max() > 0.02 * bound.max()


def test_gguf_linear_k_rejects_bad_input(kernel):
    x = torch.randn(2, 256)
    blocks = torch.from_numpy(_blocks(4, 256, GGMLQuantizationType.Q4_K, seed=0))
    with pytest.raises(RuntimeError, match="ggml_type"):
        kernel.gguf_linear_k(x, blocks, int(GGMLQuantizationType.Q4_0), False)
    with pytest.raises(RuntimeError, match="w_blocks"):
        kernel.gguf_linear_k(x, blocks, int(GGMLQuantizationType.Q6_K), False)  # Q4_K bytes read as Q6_K
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel.gguf_linear_k(torch.randn(2, 128), blocks, int(GGMLQuantizationType.Q4_K), False)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [2, 5, 130, 511])
def test_gguf_linear_k_batched_rows_odd_shapes(kernel, qtype, M):
    """Batched rows (the AVX2 path's panels of 16 weight rows by tiles of x rows): odd M, N not a
    multiple of the panel, against the same-quantization float64 reference, equal bits to the
    scalar path and across thread counts."""
    N, K = 45, 512
    x = _x(M, K, seed=M + int(qtype))
    blocks = _blocks(N, K, qtype, seed=M * 7 + int(qtype))
    xt, wt = torch.from_numpy(x), torch.from_numpy(blocks)
    y_scalar = kernel.gguf_linear_k(xt, wt, int(qtype), True)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for isa in _isas(kernel):
                y = _run_isa(kernel, isa, lambda: kernel.gguf_linear_k(xt, wt, int(qtype), False))
                assert torch.equal(y, y_scalar), f"{isa}, {n} threads"
    finally:
        torch.set_num_threads(threads)
    q, sc, mn, d, dmin = _weight_ints(blocks, qtype, K)
    parts = np.abs(d[..., None] * sc * q) + np.abs(dmin[..., None] * mn)
    scale = np.abs(x.astype(np.float64)) @ parts.reshape(N, K).T
    tight = np.abs(y_scalar.numpy().astype(np.float64) - _same_quantization_ref(x, blocks, qtype)) / scale
    assert tight.max() < 1e-5, tight.max()
