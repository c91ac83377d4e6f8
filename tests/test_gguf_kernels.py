"""The GGUF block kernels (csrc/gguf_gemv.cpp): weights in llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks
made by gguf's own quantizer, activations quantized per 32 to 8 bits as llama.cpp does
(block_q8_0, block_q8_1 for Q4_1), integer block dot products.

Three references, each for what it can check:
- numpy's block_q8_0/_1 of x (the same float32 steps): the kernel's activation blocks byte for byte;
- the same quantized x times the weights' own integers and fp16 scales, in float64: the kernel's
  result to float32 accumulation error (1e-5 of sum |x| |w|), which is all that is left;
- gguf's dequantized weights times the float x in float64 (no activation quantization): the
  kernel's result within the error the 8-bit activations imply, stated below, and visibly
  different from it (the first two references would not tell a kernel that skipped the
  activation quantization from one that did it).
The scalar path (force_scalar) does the SIMD paths' float operations in the same order: equal bits,
and so do the GEMV (one row of x) and the GEMM's register tiles (prefill rows) on both ISA paths
(AVX2's vpmaddubsw, AVX-512 VNNI's vpdpbusd: the same integers).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
QK = 32


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed? a compiler error in the log?)"
    return k


def _x(M: int, K: int, seed: int) -> np.ndarray:
    """Activations with a spread of block magnitudes, one all-zero block (scale 0) and a few outliers."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 4.0, (M, K // QK, 1)).repeat(QK, 1).reshape(
        M, K
    ).astype(np.float32)
    x[0, :QK] = 0.0
    x[M - 1, -1] = 30.0
    return x


def _weights(N: int, K: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) * 0.05 + rng.uniform(-0.02, 0.02, (N, 1))).astype(np.float32)
    return quantize(w, qtype)


def _q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's x86 quantize_row_q8_0/_1 in numpy, float32 throughout: per block of 32,
    d = amax / 127, q = round-half-even(x * (127 / amax)), s = d * sum(q). Returns (d as float32,
    q int8 [M, nb, 32], s as fp16) with d not yet rounded to fp16."""
    M, K = x.shape
    b = x.reshape(M, K // QK, QK)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8)
    s = (d[..., 0] * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float16)
    return d[..., 0], q, s


def _q8_bytes(x: np.ndarray, q8_1: bool) -> np.ndarray:
    d, q, s = _q8_ref(x)
    parts = [d.astype(np.float16)[..., None].view(np.uint8)]
    if q8_1:
        parts.append(s[..., None].view(np.uint8))
    parts.append(q.view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(x.shape[0], -1)


def _weight_ints(blocks: np.ndarray, qtype: GGMLQuantizationType, K: int):
    """(integers [N, nb, 32] int64 with value = q * d (+ m), d [N, nb], m [N, nb] or None) of GGUF blocks."""
    N = blocks.shape[0]
    b = blocks.reshape(N, K // QK, GGML_QUANT_SIZES[qtype][1])
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == GGMLQuantizationType.Q8_0:
        return b[..., 2:].view(np.int8).astype(np.int64), d, None
    off = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    nib = b[..., off:].astype(np.int64)
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)
    if qtype == GGMLQuantizationType.Q4_0:
        return q - 8, d, None
    return q, d, b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def _same_quantization_ref(x: np.ndarray, blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What the kernel computes, in float64 from the same integers: per block pair
    d_w * d_x * sum(q_w q_x) (+ m_w * s_x for Q4_1), summed over blocks."""
    K = x.shape[1]
    qw, dw, mw = _weight_ints(blocks, qtype, K)
    dx, qx, sx = _q8_ref(x)
    dx16 = dx.astype(np.float16).astype(np.float64)
    isum = np.einsum("nbi,mbi->mnb", qw, qx.astype(np.int64))
    y = np.einsum("mnb,nb,mb->mn", isum.astype(np.float64), dw, dx16)
    if mw is not None:
        y += sx.astype(np.float64) @ mw.T
    return y


def _activation_error_bound(x: np.ndarray, blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A bound on |kernel - dequant(w) @ x| [M, N] from the 8-bit activations alone.

    Per element, x is replaced by fp16(d) * q with q = round(x / d), d = amax / 127: the error is
    at most d / 2 (the rounding) + |d - fp16(d)| * |q| (the fp16 store of the scale, a relative 2^-11,
    which the plain d / 2 bound leaves out). Times |w| and summed: sum_k |w_k| e_k. Q4_1 takes the
    min's term from s = fp16(d * sum q) in place of fp16(d) * sum q: another |m| |s - fp16(d) sum q|
    per block. The float32 accumulation adds at most 1e-5 of sum |x| |w| (checked on its own)."""
    M, K = x.shape
    N = blocks.shape[0]
    w = dequantize(blocks, qtype).astype(np.float64).reshape(N, K // QK, QK)
    d, q, s = _q8_ref(x)
    d64 = d.astype(np.float64)
    d16 = d.astype(np.float16).astype(np.float64)
    e = d64[..., None] / 2 + np.abs(d64 - d16)[..., None] * np.abs(q.astype(np.float64))  # [M, nb, 32]
    bound = np.einsum("mbi,nbi->mn", e, np.abs(w))
    _, _, mw = _weight_ints(blocks, qtype, K)
    if mw is not None:
        s_err = np.abs(s.astype(np.float64) - d16 * q.astype(np.int64).sum(-1))  # [M, nb]
        bound += s_err @ np.abs(mw).T
    slack = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w.reshape(N, K)).T)
    return bound + slack


@pytest.fixture(params=["avx2", "avx512"])
def isa(kernel, request):
    """Each ISA path of the kernels (set_isa): AVX2's vpmaddubsw, or AVX-512 VNNI's vpdpbusd where built."""
    if request.param == "avx512" and not kernel.has_avx512:
        pytest.skip("this build has no AVX-512 path")
    old = kernel.set_isa(request.param)
    yield request.param
    kernel.set_isa(old)


@pytest.mark.parametrize("q8_1", [False, True])
@pytest.mark.parametrize("force_scalar", [False, True])
@pytest.mark.parametrize("M", [5, 300])  # 300 rows: quantized by both threads
def test_activation_blocks_match_llama_cpp_layout(kernel, q8_1, force_scalar, M):
    x = _x(M, 576, seed=1)
    got = kernel.quantize_q8_activations(torch.from_numpy(x), q8_1, force_scalar).numpy()
    assert got.shape == (M, 576 // QK * (36 if q8_1 else 34))
    np.testing.assert_array_equal(got, _q8_bytes(x, q8_1))


def _check_against_references(got: np.ndarray, x: np.ndarray, blocks: np.ndarray, qtype: GGMLQuantizationType):
    w = dequantize(blocks, qtype).astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T  # sum |x| |w|: the size of the float32 rounding
    # 1. The same 8-bit activations and the weights' integers in float64: only float32 accumulation differs.
    same = _same_quantization_ref(x, blocks, qtype)
    tight = np.abs(got - same) / scale
    assert tight.max() < 1e-5, tight.max()
    # 2. The float x (no activation quantization) in float64: within the bound the 8-bit activations imply...
    exact = x.astype(np.float64) @ w.T
    err = np.abs(got - exact)
    bound = _activation_error_bound(x, blocks, qtype)
    assert (err <= bound).all(), (err - bound).max()
    # ...and visibly off it: the activations were quantized (the error is not float32 rounding, which
    # reference 1 bounds), while the bound is not loose by orders of magnitude.
    assert (err / scale).max() > 100 * max(tight.max(), 1e-7)
    assert err.max() > 0.02 * bound.max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("K", [64, 576])
@pytest.mark.parametrize("M", [1, 3, 7])  # 1: the GEMV; 3 and 7: the GEMM's 4-row tiles and its 3-row tail
def test_gguf_linear_matches_llama_cpp_arithmetic(kernel, isa, qtype, K, M):
    N = 37
    x = _x(M, K, seed=M * 1000 + K)
    blocks = _weights(N, K, qtype, seed=K + int(qtype))
    assert blocks.shape == (N, K // QK * GGML_QUANT_SIZES[qtype][1])
    xt, wt = torch.from_numpy(x), kernel.gguf_pack(torch.from_numpy(blocks), int(qtype))

    y = kernel.gguf_linear(xt, wt, int(qtype), False)
    y_scalar = kernel.gguf_linear(xt, wt, int(qtype), True)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert torch.equal(y, y_scalar), "the scalar path does the SIMD path's float operations in the same order"
    _check_against_references(y.numpy().astype(np.float64), x, blocks, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [17, 64, 200, 512])
def test_gguf_gemm_is_the_gemv_bit_for_bit(kernel, isa, qtype, M):
    """Prefill rows: the packed groups' tiles of 4 rows of x (and the rows left over one at a time;
    the 5 weight rows after the last group, as stored, in 4x4 tiles and one row; the groups split
    over the threads) give the bits of one row of x at a time, the scalar path's and the other ISA
    path's, and the references' values."""
    N, K = 133, 576  # 8 packed groups of 16 weight rows, 5 rows as stored
    x = _x(M, K, seed=M)
    blocks = _weights(N, K, qtype, seed=M + int(qtype))
    xt, wt = torch.from_numpy(x), kernel.gguf_pack(torch.from_numpy(blocks), int(qtype))
    y = kernel.gguf_linear(xt, wt, int(qtype), False)
    old = kernel.set_gguf_gemm_min_rows(1 << 30)
    try:
        y_gemv = kernel.gguf_linear(xt, wt, int(qtype), False)
    finally:
        kernel.set_gguf_gemm_min_rows(old)
    assert old <= M
    assert torch.equal(y, y_gemv), "every (weight row, x row) pair does the GEMV's float operations in its order"
    assert torch.equal(y, kernel.gguf_linear(xt, wt, int(qtype), True)), "and the scalar path's"
    other = "avx512" if isa == "avx2" else "avx2"
    if other == "avx2" or kernel.has_avx512:
        kernel.set_isa(other)
        try:
            assert torch.equal(y, kernel.gguf_linear(xt, wt, int(qtype), False)), "the same integers on either ISA"
        finally:
            kernel.set_isa(isa)
    # One row at a time (the GEMV, M = 1) for a few rows: each row's result depends on that row alone.
    for m in (0, M // 2, M - 1):
        assert torch.equal(y[m : m + 1], kernel.gguf_linear(xt[m : m + 1], wt, int(qtype), False))
    _check_against_references(y.numpy().astype(np.float64), x, blocks, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N", [5, 16, 37])
def test_gguf_pack_moves_the_bytes(kernel, qtype, N):
    """gguf_pack moves the bytes (unpacking restores them exactly) and the row lookup of the packed
    matrix reads each row as the file stores it."""
    blocks = torch.from_numpy(_weights(N, 64, qtype, seed=N))
    packed = kernel.gguf_pack(blocks, int(qtype))
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    if N >= 16:
        assert not torch.equal(packed[:16], blocks[:16]), "a group is packed"
    assert torch.equal(packed[N // 16 * 16 :], blocks[N // 16 * 16 :]), "the rows after the last group as stored"
    assert torch.equal(kernel.gguf_pack(packed, int(qtype), True), blocks)
    ids = torch.tensor([N - 1, 0, N // 2, 0])
    assert torch.equal(kernel.gguf_packed_rows(packed, ids, int(qtype)), blocks[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.gguf_packed_rows(packed, torch.tensor([N]), int(qtype))


def test_gguf_linear_rejects_bad_input(kernel):
    x = torch.randn(2, 64)
    blocks = torch.from_numpy(_weights(4, 64, GGMLQuantizationType.Q4_0, seed=0))
    with pytest.raises(RuntimeError, match="ggml_type"):
        kernel.gguf_linear(x, blocks, int(GGMLQuantizationType.Q4_K), False)
    with pytest.raises(RuntimeError, match="w_blocks"):
        kernel.gguf_linear(x, blocks, int(GGMLQuantizationType.Q8_0), False)  # Q4_0 bytes read as Q8_0
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.gguf_linear(torch.randn(2, 48), blocks, int(GGMLQuantizationType.Q4_0), False)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    ("M", "N", "K"),
    # 1568: 49 blocks, 88-row runs of x (Q8_0) and five chunks of broadcast x (Q4); N = 229: 14 groups, more
    # than one group block at K = 1568
    [(1, 37, 96), (3, 37, 96), (17, 133, 96), (511, 133, 96), (255, 45, 1568), (7, 229, 1568)],
)
def test_gguf_gemm_odd_shapes_same_bits_on_every_path_and_thread_count(kernel, isa, qtype, M, N, K):
    """Odd shapes (M not a multiple of the 4-, 6- or 8-row tiles, N not one of the 16-row groups, K a
    number of blocks that is not a power of two; at K = 1568 the rows of x split into several
    cache-blocking runs, the blocks into chunks and, on one thread at N = 229, the groups into
    blocks): one thread and two give the same bits (the threads split whole groups, each (weight
    row, x row) pair's float operations are the same), as do the scalar path and one row of x at a
    time, within the references' bounds."""
    x = _x(M, K, seed=M + K)
    blocks = _weights(N, K, qtype, seed=N + K + int(qtype))
    xt, wt = torch.from_numpy(x), kernel.gguf_pack(torch.from_numpy(blocks), int(qtype))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = kernel.gguf_linear(xt, wt, int(qtype), False)
        torch.set_num_threads(2)
        y2 = kernel.gguf_linear(xt, wt, int(qtype), False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2), "1 thread and 2 threads"
    assert torch.equal(y1, kernel.gguf_linear(xt, wt, int(qtype), True)), "the scalar path"
    old = kernel.set_gguf_gemm_min_rows(1 << 30)
    try:
        assert torch.equal(y1, kernel.gguf_linear(xt, wt, int(qtype), False)), "one row of x at a time"
    finally:
        kernel.set_gguf_gemm_min_rows(old)
    _check_against_references(y1.numpy().astype(np.float64), x, blocks, qtype)
