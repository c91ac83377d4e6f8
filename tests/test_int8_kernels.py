"""INT8 W8A8 CPU kernels (csrc/int8_gemm.cpp) against float64 references.

- quantize_int8_per_token: the same bytes and scales as torch's
  (int8.quantize_per_token: s = max|x| / 127, q = round-half-even(x / s)).
- int8_linear: the float64 product of the same integers, scaled, within
  1e-6 relative (the integer sums are exact; only the epilogue rounds).
- Against float x @ w_deq.T (w_deq = w * w_scale, the dequantized weight):
  per-token quantization moves each x_k by at most s_x / 2, so
  |y - x w_deq^T| <= s_x / 2 * sum_k |w_deq[n, k]| per output (plus float32
  rounding, taken as 1e-5 of the float64 magnitude), checked elementwise.
- scalar == AVX2 == AVX-512 (VNNI) bit for bit: GEMV (M = 1) and GEMM rows,
  odd row counts up to 511, odd N, K not a multiple of the 32-byte step, and
  the same bits on 1 and 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from shoal.workers.model_executor.layers.quantization.int8 import (
    int8_linear_reference,
    quantize_per_channel,
    quantize_per_token,
)
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    kernels is None or not getattr(kernels, "has_avx2", False), reason="CPU kernels unavailable (no compiler or AVX2)"
)

MS = (1, 3, 5, 17, 64, 129)
KS = (64, 100, 576)
N = 37  # odd: a tile of 4 rows and a remainder


def _isas() -> list[str]:
    return ["avx2", "avx512"] if kernels is not None and getattr(kernels, "has_avx512", False) else ["avx2"]


@pytest.fixture
def isa():
    """Restores the ISA the test changes."""
    old = kernels.get_isa()
    yield kernels.set_isa
    kernels.set_isa(old)


def _problem(M: int, K: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[0, K // 3] = 9.0  # an outlier: a coarse scale for that row
    if M > 2:
        x[2] = 0.0  # a zero row: scale 0, output = bias
    wq, ws = quantize_per_channel(torch.randn(N, K, generator=g) * 0.05)
    b = torch.randn(N, generator=g) if bias else None
    return x, wq, ws, b


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("scalar", [False, True])
def test_quantize_matches_torch(K, scalar):
    x, *_ = _problem(17, K)
    q, s = kernels.quantize_int8_per_token(x, force_scalar=scalar)
    q_ref, s_ref = quantize_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    assert q.abs().max() <= 127 and s[2] == 0


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("M", MS)
def test_linear_against_float64(M, K, isa):
    x, wq, ws, b = _problem(M, K, seed=M * 1000 + K)
    q, s = quantize_per_token(x)
    exact = (q.double() @ wq.double().T) * s.double()[:, None] * ws.double() + b.double()
    w_deq = wq.double() * ws.double()[:, None]
    # Activation quantization: |x_k - s q_k| <= s / 2.
    bound = s.double()[:, None] / 2 * w_deq.abs().sum(1)
    float_ref = x.double() @ w_deq.T + b.double()
    outs = {}
    for name in _isas():
        isa(name)
        outs[name] = kernels.int8_linear(x, wq, ws, b)
    outs["scalar"] = kernels.int8_linear(x, wq, ws, b, force_scalar=True)
    for name, y in outs.items():
        assert y.shape == (M, N) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item(), msg=name)
        err = (y.double() - float_ref).abs()
        assert (err <= bound + 1e-5 * float_ref.abs().max()).all(), f"{name}: past the activation bound"
        assert torch.equal(y, outs["scalar"]), f"{name} != scalar"
    assert torch.equal(outs["scalar"][2], b) if M > 2 else True
    # The torch reference (the method's fallback) agrees to rounding.
    torch.testing.assert_close(int8_linear_reference(x, wq, ws, b), outs["scalar"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("M", [1, 5])
def test_linear_without_bias_and_threads(M, isa):
    x, wq, ws, _ = _problem(M, 100, bias=False)
    one = kernels.int8_linear(x, wq, ws)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = kernels.int8_linear(x, wq, ws)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, kernels.int8_linear(x, wq, ws, None, force_scalar=True))


@pytest.mark.parametrize(("M", "K", "N"), [(2, 32, 4), (7, 608, 70), (255, 200, 13), (511, 96, 70)])
def test_gemm_tiles_and_chunks(M, K, N, isa):
    """The AVX2 GEMM's edges: odd M (a 1-row tile after the 2-row ones, and
    x chunks that end mid-matrix), K with and without a tail past the 32-byte
    steps, N past the 4-row tiles; exact against float64 and the same bits on
    1 and 2 threads."""
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g)
    wq, ws = quantize_per_channel(torch.randn(N, K, generator=g))
    b = torch.randn(N, generator=g)
    q, s = quantize_per_token(x)
    exact = (q.double() @ wq.double().T) * s.double()[:, None] * ws.double() + b.double()
    threads = torch.get_num_threads()
    for name in _isas():
        isa(name)
        try:
            torch.set_num_threads(1)
            one = kernels.int8_linear(x, wq, ws, b)
            torch.set_num_threads(2)
            two = kernels.int8_linear(x, wq, ws, b)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(one.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item(), msg=name)
        assert torch.equal(one, two), name
        assert torch.equal(one, kernels.int8_linear(x, wq, ws, b, force_scalar=True)), name


def test_extreme_values_are_exact():
    """All +-127 on both sides (the largest products): no saturation on either ISA path."""
    K = 576
    x = torch.full((3, K), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    wq = torch.full((5, K), 127, dtype=torch.int8)
    wq[1] = -127
    wq[2, 1::3] = -127
    ws = torch.ones(5)
    q, s = quantize_per_token(x)
    exact = (q.double() @ wq.double().T) * s.double()[:, None]
    for name in _isas():
        old = kernels.set_isa(name)
        try:
            torch.testing.assert_close(kernels.int8_linear(x, wq, ws).double(), exact, rtol=1e-6, atol=0)
        finally:
            kernels.set_isa(old)


def test_bad_arguments():
    x = torch.randn(2, 64)
    wq, ws = quantize_per_channel(torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="int8"):
        kernels.int8_linear(x, wq.float(), ws)
    with pytest.raises(RuntimeError, match="K"):
        kernels.int8_linear(torch.randn(2, 65), wq, ws)
    with pytest.raises(RuntimeError, match="w_scale"):
        kernels.int8_linear(x, wq, ws[:2])
