"""The quantized-matmul kernels of layers/quantization/triton_quant.py, run
by Triton's interpreter on the CPU on small odd shapes, against float64
products of the same integers (INT8) or of the same dequantized weights
(INT4), and the FP8 reference path against the float matmul."""

from __future__ import annotations

import os

# Triton picks interpreted or compiled when a kernel is decorated: before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the quantized-kernel tests need the triton package")

from shoal.workers.model_executor.layers.quantization import triton_quant as tq

# Output rounding of the dtype (and float32 accumulation), relative to the largest |output|.
OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = OUT_TOL[dtype] * max(ref.abs().max().item(), 1.0)
    err = (y.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.fixture(autouse=True)
def _interpreted():
    assert tq.interpreted(), "TRITON_INTERPRET=1 must be set before triton is first imported"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 48), (5, 96), (33, 48)])
def test_per_token_int8_equals_its_torch_reference(m, k, dtype):
    torch.manual_seed(m + k)
    x = (torch.randn(m, k) * torch.rand(m, 1) * 10).to(dtype)
    x[0, :] = 0  # an all-zero row: finite scale, zero values
    q, s = tq.per_token_quant_int8(x)
    q_ref, s_ref = tq.per_token_quant_int8_ref(x)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.shape == (m, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # x / s may land a hair either side of a .5 tie: at most one step apart
    assert (q.int() - q_ref.int()).abs().max() <= 1 and (q != q_ref).float().mean() < 0.01
    assert q.abs().max() <= 127 and (q[1:].abs().amax(dim=1) == 127).all()
    assert ((q.float() * s - x.float()).abs() <= s / 2 + 1e-6).all()  # round to nearest


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 24, 48), (5, 72, 96), (33, 24, 96), (33, 72, 48)])
def test_int8_w8a8_equals_the_float64_product_of_its_integers(m, n, k, dtype, bias):
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k).to(dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ws = torch.rand(n) / 100 + 1e-3
    b = torch.randn(n).to(dtype) if bias else None
    y = tq.int8_w8a8_mm(x, w, ws, b)
    assert y.shape == (m, n) and y.dtype == dtype
    # the reference: the same per-token integers (from the torch quantizer), multiplied in float64
    _close(y, tq.int8_w8a8_mm_ref(x, w, ws, b, torch.float64), dtype)
    assert tq.int8_w8a8_mm(x, w, ws, b, out_dtype=torch.float32).dtype == torch.float32


def test_pack_and_unpack_int4_round_trip_in_the_compressed_tensors_layout():
    w = torch.randint(-8, 8, (24, 256), dtype=torch.int8)
    packed = tq.pack_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (24, 32)
    assert torch.equal(tq.unpack_int4(packed, 256), w)
    # element j of a pack in bits 4j..4j+3, stored as v + 8
    one = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, -1]], dtype=torch.int8)
    want = sum((v + 8) << (4 * j) for j, v in enumerate(one[0].tolist()))
    assert tq.pack_int4(one).item() == want - 2**32 * (want >= 2**31)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        tq.pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 8"):
        tq.pack_int4(torch.zeros(1, 12, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 24, 128), (5, 72, 256), (33, 24, 256)])
def test_w4a16_equals_the_float64_product_of_its_dequantized_weights(m, n, k, dtype):
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k).to(dtype)
    packed = tq.pack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8))
    scale = (torch.rand(n, k // 128) / 10 + 0.01).to(dtype)
    b = torch.randn(n).to(dtype)
    y = tq.w4a16_mm(x, packed, scale, 128, b)
    assert y.shape == (m, n) and y.dtype == dtype
    # the weights as the kernel multiplies them: dequantized, rounded to x's dtype
    w = tq.dequantize_int4(packed, scale, k, 128).to(dtype).double()
    _close(y, x.double() @ w.t() + b.double(), dtype)


def test_w4a16_refuses_a_scale_of_the_wrong_shape():
    x, packed = torch.randn(2, 256), torch.zeros(24, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w_scale must be \[24, 2\]"):
        tq.w4a16_mm(x, packed, torch.ones(24, 1), 128)


@pytest.mark.parametrize("m,k", [(1, 48), (5, 96), (33, 48)])
def test_per_token_fp8_scales_each_row_to_the_e4m3_range(m, k):
    torch.manual_seed(k)
    x = torch.randn(m, k) * torch.rand(m, 1) * 100
    q, s = tq.per_token_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1)
    torch.testing.assert_close(s, x.abs().amax(dim=1, keepdim=True) / 448)
    assert (q.float().abs().amax(dim=1) == 448).all()
    # e4m3: 3 mantissa bits, relative error at most 2^-4 above the subnormals (2^-6)
    v, back = x / s, q.float()
    normal = v.abs() >= 2**-6
    assert ((back - v).abs()[normal] <= 2**-4 * v.abs()[normal]).all()
    assert ((back - v).abs()[~normal] <= 2**-10).all()


# Per element, e4m3 rounding is at most 2^-4 relative (plus 2^-10 * scale below 2^-6 * scale);
# a product of two rounded values is off by at most (2 * 2^-4 + 2^-8) |x| |w|, so each output
# is within FP8_BOUND * (|x| @ |w|.T) of the float product (tiny absolute slack for the subnormals).
FP8_BOUND = 2 * 2**-4 + 2**-8


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 24, 48), (5, 72, 96), (33, 24, 96)])
def test_fp8_reference_path_is_within_the_e4m3_bound_of_the_float_product(m, n, k, per_channel):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k)
    w = torch.randn(n, k) * (torch.rand(n, 1) + 0.1)  # rows of different ranges
    q, s = tq.quantize_weight_fp8(w, per_channel)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ((n,) if per_channel else (1,))
    b = torch.randn(n)
    y = tq.fp8_w8a8_mm(x, q, s, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = x.double() @ w.double().t() + b.double()
    bound = FP8_BOUND * (x.double().abs() @ w.double().abs().t()) + 1e-4
    assert ((y.double() - ref).abs() <= bound).all()
    # and as a whole, far inside the worst case (errors of both signs cancel)
    assert (y.double() - ref).norm() / ref.norm() < 0.06
    # the same fp8 numbers scaled_mm multiplies: xq * xs @ (q * s).T
    xq, xs = tq.per_token_quant_fp8(x)
    want = (xq.double() * xs.double()) @ (q.double() * s.double().reshape(-1, 1)).t() + b.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_fp8_takes_leading_dims_and_refuses_bad_scales():
    w, s = tq.quantize_weight_fp8(torch.randn(16, 32), per_channel=True)
    assert tq.fp8_w8a8_mm(torch.randn(2, 3, 32), w, s).shape == (2, 3, 16)
    with pytest.raises(ValueError, match="w_scale must be"):
        tq.fp8_w8a8_mm(torch.randn(2, 32), w, torch.ones(3))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tq.fp8_w8a8_mm(torch.randn(2, 32), w.float(), s)
    assert tq.scaled_mm_kind(torch.randn(2, 32), w, torch.bfloat16) is None  # the CPU: the reference
