"""Quantized matmuls on the GPU: INT8 W8A8 and INT4 W4A16 as Triton kernels,
FP8 W8A8 through torch._scaled_mm, each beside a torch reference.

- INT8 W8A8: activations quantized per token (symmetric, scale amax/127),
  weights int8 per output channel; int8 x int8 dot products accumulate in
  int32 and both scales are applied once, in the epilogue.
- INT4 W4A16: compressed-tensors' "pack-quantized" weights (eight 4-bit
  values to an int32 along the input features, value v stored as v + 8,
  element j at bits 4j..4j+3), one scale per group of input features;
  unpacked in registers and multiplied in the activations' dtype.
- FP8 W8A8 (e4m3): activations quantized per token (scale amax/448),
  weights per tensor or per output channel. On Hopper (and Ada) cuBLASLt /
  CUTLASS multiply the fp8 values; elsewhere the reference dequantizes them
  to float32, the same products summed in another order.

Triton runs the kernels on CUDA tensors, and on CPU tensors only under
TRITON_INTERPRET=1 set before triton is first imported (the tests: Triton
decorates its own library then); other CPU tensors take the torch
references. A CPU-only install needs no triton.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only installs: the torch references serve
    triton = None

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A row of zeros still gets a finite scale (and quantizes to zeros).
MIN_AMAX = 1e-10

if triton is not None:
    _TL_MIN_AMAX = tl.constexpr(MIN_AMAX)  # a kernel reads only constexpr globals

    @triton.jit
    def _per_token_quant_kernel(
        q_ptr, s_ptr, x_ptr, stride_q, stride_x, K, QMAX: tl.constexpr, INT: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0), _TL_MIN_AMAX) / QMAX
        v = x / s
        if INT:  # round half away from zero (tl has no round; the reference rounds the same way)
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        tl.store(q_ptr + row * stride_q + cols, v.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, s)

    @triton.jit
    def _int8_mm_kernel(
        out_ptr,
        a_ptr,
        b_ptr,
        sa_ptr,
        sb_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_bn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                a_ptr + rm[:, None].to(tl.int64) * stride_am + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0,
            )
            # the weight tile read transposed: [BLOCK_K, BLOCK_N] of w [N, K]
            b = tl.load(
                b_ptr + rn[None, :].to(tl.int64) * stride_bn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0,
            )
            acc += tl.dot(a, b, out_dtype=tl.int32)
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _w4a16_mm_kernel(
        out_ptr,
        x_ptr,
        w_ptr,
        s_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_om,
        GROUP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(
                x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            wk = (rn[None, :] < N) & (kk[:, None] < K)
            # [BLOCK_K, BLOCK_N]: each int32 is read for its 8 values (from cache after the first)
            packed = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (kk[:, None] // 8), mask=wk, other=0)
            u = (packed >> ((kk[:, None] % 8) * 4)) & 0xF
            scale = tl.load(s_ptr + rn[None, :].to(tl.int64) * stride_sn + (kk[:, None] // GROUP), mask=wk, other=0.0)
            # masked columns: u = 0 gives -8 * 0 = 0
            w = ((u - 8).to(tl.float32) * scale.to(tl.float32)).to(x_ptr.dtype.element_ty)
            if UPCAST:  # the same exact products in float32: the interpreter cannot multiply bfloat16
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(
            out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok
        )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """Asked once a device: each layer's call on the hot path reads it."""
    return torch.cuda.get_device_capability(device)


def _on_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x: CUDA, or the interpreter on the CPU."""
    if triton is None:
        return False
    return x.device.type == "cuda" or interpreted()


def interpreted() -> bool:
    """Whether Triton runs its interpreter here (TRITON_INTERPRET=1 when triton was imported)."""
    return triton is not None and isinstance(_int8_mm_kernel, InterpretedFunction)


def _block_m(m: int) -> int:
    """Rows a program covers: tl.dot needs at least 16; a decode step has few."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _check_2d(name: str, t: torch.Tensor, cols: int | None = None) -> None:
    if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
        want = f"[rows, {cols}]" if cols is not None else "2-D"
        raise ValueError(f"{name} must be {want}; got shape {tuple(t.shape)}")


# ---- per-token activation quantization ----


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def per_token_quant_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], s float32 [M, 1]) with x ~ q * s, in torch."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / INT8_MAX
    q = _round_half_away(xf / s).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [M, K], s float32 [M, 1]) with x ~ q * s, in torch."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def _per_token_quant(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("x", x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        warps = 4 if block <= 2048 else 8 if block <= 8192 else 16  # a whole row in one program's registers
        _per_token_quant_kernel[(m,)](
            q, s, x, q.stride(0), x.stride(0), k, QMAX=qmax, INT=dtype == torch.int8, BLOCK=block, num_warps=warps
        )
    return q, s


def per_token_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: s = amax|row| / 127, q = round(x / s) in
    [-127, 127] (ties away from zero); one Triton program a row."""
    if not _on_triton(x):
        return per_token_quant_int8_ref(x)
    return _per_token_quant(x, torch.int8, INT8_MAX)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: s = amax|row| / 448, q = x / s rounded to e4m3. One
    Triton launch on CUDA (eager torch takes five); the reference elsewhere:
    Triton's interpreter rounds to fp8 otherwise than torch and the GPU do
    (measured: 3.5% of values a step or two apart)."""
    if x.device.type != "cuda" or triton is None or _capability(x.device) < (8, 9):
        return per_token_quant_fp8_ref(x)
    return _per_token_quant(x, FP8_DTYPE, FP8_MAX)


# ---- INT8 W8A8 ----


def int8_w8a8_mm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The same products in float64 (exact for int8 x int8 sums of this size)."""
    q, s = per_token_quant_int8_ref(x)
    y = (q.double() @ w.double().t()) * s.double() * w_scale.double().reshape(1, -1)
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


def int8_w8a8_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ (w int8 [N, K] * w_scale [N]).T (+ bias) with x quantized
    per token: int32 accumulation, both scales in the epilogue."""
    _check_2d("x", x)
    _check_2d("w", w, x.shape[1])
    if w.dtype != torch.int8:
        raise ValueError(f"w must be int8; got {w.dtype}")
    n, k = w.shape
    if w_scale.numel() != n:
        raise ValueError(f"w_scale must hold one scale per output row ({n}); got shape {tuple(w_scale.shape)}")
    out_dtype = out_dtype or x.dtype
    if not _on_triton(x):
        return int8_w8a8_mm_ref(x, w, w_scale, bias, out_dtype)
    q, s = per_token_quant_int8(x)
    w = w if w.stride(-1) == 1 else w.contiguous()
    ws = w_scale.reshape(-1).float().contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    bm, bn, bk = _block_m(m), 64, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int8_mm_kernel[grid](
        out,
        q,
        w,
        s,
        ws,
        bias if bias is not None else ws,
        m,
        n,
        k,
        q.stride(0),
        w.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out


# ---- INT4 W4A16 (compressed-tensors pack-quantized) ----


def pack_int4(w: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] of values in [-8, 7] -> int32 [N, K // 8]: v + 8 in
    bits 4j..4j+3 of its pack for element j (j = 0 lowest)."""
    _check_2d("w", w)
    n, k = w.shape
    if k % 8:
        raise ValueError(f"int4 packing takes 8 values an int32: K ({k}) must be a multiple of 8")
    if w.numel() and (int(w.min()) < -8 or int(w.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    u = (w.to(torch.int64) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    packed = (u << shifts).sum(dim=-1)  # disjoint bits: the sum is the bitwise or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(w_packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, K // 8] -> int8 [N, K] of values in [-8, 7]."""
    _check_2d("w_packed", w_packed)
    if w_packed.shape[1] * 8 < k:
        raise ValueError(f"{w_packed.shape[1]} packs hold {w_packed.shape[1] * 8} values, fewer than K = {k}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w_packed.device)
    u = (w_packed.unsqueeze(-1) >> shifts) & 0xF
    return (u.reshape(w_packed.shape[0], -1)[:, :k] - 8).to(torch.int8)


def dequantize_int4(w_packed: torch.Tensor, w_scale: torch.Tensor, k: int, group_size: int = 128) -> torch.Tensor:
    """float32 [N, K]: (u - 8) * w_scale[n, k // group_size]."""
    scale = w_scale.float().repeat_interleave(group_size, dim=1)[:, :k]
    return unpack_int4(w_packed, k).float() * scale


def _group(group_size: int | None, k: int) -> int:
    """compressed-tensors writes -1 (or nothing) for one group a row."""
    return k if group_size is None or group_size <= 0 else group_size


def w4a16_mm_ref(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int = 128,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    k = x.shape[-1]
    w = dequantize_int4(w_packed, w_scale, k, _group(group_size, k)).to(x.dtype)
    y = x @ w.t()
    return y if bias is None else y + bias.to(y.dtype)


def w4a16_mm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int = 128,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T with W the dequantized int4 weights [N, K], in x's dtype
    (float32 accumulation); the weights are unpacked per tile in registers."""
    _check_2d("x", x)
    m, k = x.shape
    if k % 8:
        raise ValueError(f"K ({k}) must be a multiple of 8 for packed int4 weights")
    _check_2d("w_packed", w_packed, k // 8)
    if w_packed.dtype != torch.int32:
        raise ValueError(f"w_packed must be int32; got {w_packed.dtype}")
    n = w_packed.shape[0]
    g = _group(group_size, k)
    groups = -(-k // g)
    if tuple(w_scale.shape) != (n, groups):
        raise ValueError(f"w_scale must be [{n}, {groups}] (group size {g}); got {tuple(w_scale.shape)}")
    if not _on_triton(x):
        return w4a16_mm_ref(x, w_packed, w_scale, g, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_packed = w_packed if w_packed.stride(-1) == 1 else w_packed.contiguous()
    w_scale = w_scale if w_scale.stride(-1) == 1 else w_scale.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _block_m(m), 64, 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4a16_mm_kernel[grid](
        out,
        x,
        w_packed,
        w_scale,
        bias if bias is not None else w_scale,
        m,
        n,
        k,
        x.stride(0),
        w_packed.stride(0),
        w_scale.stride(0),
        out.stride(0),
        GROUP=g,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,  # no TF32 rounding for a float32 model
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out


# ---- FP8 W8A8 ----


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [N, K], s float32 [N] per channel or [1] per tensor), w ~ q * s."""
    _check_2d("w", w)
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax().reshape(1)
    s = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (wf / s.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def fp8_w8a8_mm_ref(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The fp8 values dequantized to float32 and multiplied: scaled_mm's
    numbers up to the order of the sums."""
    y = (xq.float() @ w.float().t()) * xs * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_mm_kind(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """How torch._scaled_mm takes this product, or None (the reference):
    "rowwise" (per-token x per-channel scales inside the GEMM: Hopper and
    later, bfloat16 out), "unit" (scales of 1, float32 out, the scales
    applied after: Ada, or another out dtype). cuBLASLt wants K and N
    multiples of 16."""
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    n, k = w.shape
    if k % 16 or n % 16:
        return None
    cap = _capability(x.device)
    if cap >= (9, 0) and out_dtype == torch.bfloat16:
        return "rowwise"
    if cap >= (8, 9):
        return "unit"
    return None


def fp8_w8a8_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ (w e4m3 [N, K] * w_scale).T (+ bias), x quantized to e4m3
    per token at each call; w_scale float32 [N] (per channel) or [1] (per tensor)."""
    k = x.shape[-1]
    _check_2d("w", w, k)
    if w.dtype != FP8_DTYPE:
        raise ValueError(f"w must be {FP8_DTYPE}; got {w.dtype}")
    n = w.shape[0]
    if w_scale.numel() not in (1, n):
        raise ValueError(f"w_scale must be [1] (per tensor) or [{n}] (per channel); got {tuple(w_scale.shape)}")
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    xq, xs = per_token_quant_fp8(x2)
    kind = scaled_mm_kind(x2, w, out_dtype)
    if kind is None:
        y = fp8_w8a8_mm_ref(xq, xs, w, w_scale, bias, out_dtype)
    elif kind == "rowwise":
        # scale_a [M, 1] and scale_b [1, N] float32; the second operand column-major (w.t() of row-major w)
        ws = w_scale.float().reshape(1, -1)
        if ws.shape[1] != n:
            ws = ws.expand(1, n).contiguous()
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias.to(y.dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y * xs * w_scale.float().reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
    return y.to(out_dtype).reshape(*lead, n)
