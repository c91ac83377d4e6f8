"""One Triton kernel each for RMSNorm (optionally with the residual add),
SiLU-and-multiply and the rotary embedding, where eager torch launches
several. Math in float32; results in the input's dtype.

The layers call these on CUDA tensors, and on CPU tensors only when
EngineArgs.fused_ops asks for it and TRITON_INTERPRET=1 was set before this
module was first imported (Triton picks interpreted or compiled when a
kernel is decorated). The layers import this module lazily, so a CPU-only
install needs no triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    eps,
    stride_o,
    stride_x,
    stride_r,
    hidden,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    # Arithmetic in float32 only (Triton's interpreter cannot do it on bfloat16).
    xf = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # Rounded to the dtype before the norm, as `residual + x` in torch is.
        r = xf + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        r = r.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=ok)
        xf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # weight * normed.to(dtype), rounded as RMSNorm's torch path (and transformers) round it
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_o, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(
    dst_ptr,
    src_ptr,
    token,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    half,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Hugging Face's rotate_half layout: dims [0, half) pair with [half, 2 * half)."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    ok = (heads < num_heads) & (dims < half)
    src = src_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=ok, other=0.0).to(tl.float32)
    dst = dst_ptr + token * num_heads * 2 * half + heads * 2 * half + dims  # contiguous output
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_q_heads,
    num_k_heads,
    half,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    # The tables hold cat(freqs, freqs): the first half covers both.
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate_heads(q_out_ptr, q_ptr, token, stride_qt, stride_qh, num_q_heads, cos, sin, half, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_out_ptr, k_ptr, token, stride_kt, stride_kh, num_k_heads, cos, sin, half, K_HEADS_PAD, HALF_PAD)


def _check_runs_on(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not isinstance(_rms_norm_kernel, InterpretedFunction):
        raise RuntimeError(
            "the fused Triton ops need CUDA (on the CPU, only under TRITON_INTERPRET=1 "
            "set before the first import of fused_ops)"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as [rows, hidden] with a unit stride along hidden."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_runs_on(x)
    rows = _rows(x)
    res = rows if residual is None else residual.view(-1, x.shape[-1])  # view: the update must land in place
    out = torch.empty_like(rows)
    hidden = rows.shape[-1]
    _rms_norm_kernel[(rows.shape[0],)](
        out,
        rows,
        res,
        weight,
        eps,
        out.stride(0),
        rows.stride(0),
        res.stride(0),
        hidden,
        ADD_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
    )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place, then the norm of the new residual (vLLM's
    fused_add_rms_norm). residual must be contiguous."""
    if not residual.is_contiguous() or residual.shape != x.shape:
        raise ValueError("fused_add_rms_norm updates residual in place: it must be contiguous and shaped like x")
    return _norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    _check_runs_on(x)
    rows = _rows(x)
    n = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
        out, rows, out.stride(0), rows.stride(0), n, BLOCK=block
    )
    return out.view(*x.shape[:-1], n)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] (views into the
    fused qkv output are fine); cos/sin: [max_positions, head_dim].
    Returns new contiguous q and k, as the torch path does."""
    _check_runs_on(q)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    half = q.shape[-1] // 2
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    _rotary_kernel[(q.shape[0],)](
        q_out,
        k_out,
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        q.shape[1],
        k.shape[1],
        half,
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half),
    )
    return q_out, k_out
