"""The grouped LoRA update (ops.add_lora) as two Triton kernels, for CUDA.

ops.add_lora walks a Python list of segments: each step's launches (their
number and their shapes) follow how many adapters the step holds and where
their rows lie, and the list is built on the host from the step's rows. A
CUDA graph captures fixed launches, so here the step is described by a
per-row slot index instead (vLLM's token_lora_indices): row_slots [T], each
row's slot or NO_LORA (-1), read on the device. Every grid follows from T,
in, out, R and fixed block sizes alone; nothing is read back to the host.

- shrink: scratch[T, R] (float32) = scalings[slot] * x @ A[slot], one
  program per tile of BLOCK_M rows x BLOCK_R rank columns (and, for a step
  too small to fill the GPU, one per SPLIT_K share of the input features,
  added atomically into zeroed scratch; the sum's order then varies from run
  to run, within float32 rounding);
- expand: y[:, out_offset : out_offset + out] += scratch @ B[slot], one
  program per tile of BLOCK_M rows x BLOCK_N output columns, the update
  rounded to y's dtype before the add, as ops.add_lora rounds it.

A tile's rows may hold several slots: its program takes each slot between
the tile's least and greatest in turn, skips one with no row in the tile,
and masks the other rows' inputs to zero, so a tile costs one pass a
distinct slot in it (rows of one sequence are consecutive: most tiles hold
one). Rows of NO_LORA, or of a slot outside [0, slots), are never written.
Slots are zero-padded past an adapter's rank, and the padding adds exact
zeros. Products accumulate in float32; 16-bit operands of one dtype go to
tl.dot as they are (tensor cores), other mixes (float32, or bfloat16 slots
under a float32 model) as float32 at full ("ieee") precision.

Triton decides at decoration time whether a kernel is compiled or
interpreted, so TRITON_INTERPRET=1 must be set before triton is first
imported for this to run on CPU tensors (the tests). A CPU-only install
needs no triton: the layers use ops.add_lora there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU-only installs: ops.add_lora serves
    triton = None

_NATIVE_DOT = (torch.float16, torch.bfloat16)
_SLOT_DTYPES = (torch.int32, torch.int64)
# Programs a shrink launch should reach before it is split along the input
# features (an H100/H200 has 132 SMs; untuned).
_SHRINK_MIN_PROGRAMS = 256
_MAX_SPLIT_K = 64
BLOCK_K = 64  # input features a shrink program takes at a time
BLOCK_N = 64  # output columns of an expand program

if triton is not None:

    @triton.jit
    def _tile_slots(slots_ptr, num_rows, num_slots, pid_m, BLOCK_M: tl.constexpr):
        """The tile's rows, their slots, which of them take an update, and the tile's least and greatest slot."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slots_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int32)
        valid = (slots >= 0) & (slots < num_slots)
        lo = tl.min(tl.where(valid, slots, num_slots), axis=0)
        hi = tl.max(tl.where(valid, slots, -1), axis=0)
        return rows.to(tl.int64), slots, valid, lo, hi

    # The number of rows changes every step: left unspecialized so that
    # T = 1 or a multiple of 16 costs no compile of its own.
    @triton.jit(do_not_specialize=["num_rows"])
    def _shrink_kernel(
        scratch_ptr,
        x_ptr,
        a_ptr,
        slots_ptr,
        scalings_ptr,
        num_rows,
        in_features,
        rank,
        num_slots,
        stride_xm,
        stride_xk,
        stride_as,
        stride_ak,
        stride_ar,
        stride_sm,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_m, pid_r, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows, slots, valid, lo, hi = _tile_slots(slots_ptr, num_rows, num_slots, pid_m, BLOCK_M)
        cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        col_ok = cols < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        # An empty tile (all base rows) has lo > hi: no pass at all.
        for s in range(lo, hi + 1):
            sel = valid & (slots == s)
            if tl.max(sel.to(tl.int32), axis=0) > 0:
                a_base = a_ptr + tl.cast(s, tl.int64) * stride_as
                # This program's share of the input features: every SPLIT_K-th chunk.
                for k0 in range(pid_k * BLOCK_K, in_features, SPLIT_K * BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_ok = ks < in_features
                    # Rows of other slots (and base rows) load zeros: they add exact zeros.
                    xt = tl.load(
                        x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=sel[:, None] & k_ok[None, :],
                        other=0.0,
                    )
                    at = tl.load(
                        a_base + ks[:, None] * stride_ak + cols[None, :] * stride_ar,
                        mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0,
                    )
                    if NATIVE_DOT and not UPCAST:
                        acc = tl.dot(xt, at, acc)
                    else:
                        acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        scale = tl.load(scalings_ptr + slots, mask=valid, other=0.0)
        acc = acc * scale[:, None]
        out = scratch_ptr + rows[:, None] * stride_sm + cols[None, :]
        ok = valid[:, None] & col_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out, acc, mask=ok)
        else:
            tl.atomic_add(out, acc, mask=ok)

    @triton.jit(do_not_specialize=["num_rows"])
    def _expand_kernel(
        y_ptr,
        scratch_ptr,
        b_ptr,
        slots_ptr,
        num_rows,
        rank,
        out_features,
        num_slots,
        stride_ym,
        stride_yn,
        stride_sm,
        stride_bs,
        stride_br,
        stride_bn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        NATIVE_DOT: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows, slots, valid, lo, hi = _tile_slots(slots_ptr, num_rows, num_slots, pid_m, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < out_features
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(lo, hi + 1):
            sel = valid & (slots == s)
            if tl.max(sel.to(tl.int32), axis=0) > 0:
                b_base = b_ptr + tl.cast(s, tl.int64) * stride_bs
                for r0 in range(0, rank, BLOCK_R):
                    rs = r0 + tl.arange(0, BLOCK_R)
                    r_ok = rs < rank
                    st = tl.load(
                        scratch_ptr + rows[:, None] * stride_sm + rs[None, :],
                        mask=sel[:, None] & r_ok[None, :],
                        other=0.0,
                    )
                    bt = tl.load(
                        b_base + rs[:, None] * stride_br + cols[None, :] * stride_bn,
                        mask=r_ok[:, None] & col_ok[None, :],
                        other=0.0,
                    )
                    if NATIVE_DOT:  # the shrunk values rounded to B's (and y's) 16-bit dtype, as vLLM's expand does
                        st = st.to(bt.dtype)
                    if NATIVE_DOT and not UPCAST:
                        acc = tl.dot(st, bt, acc)
                    else:
                        acc = tl.dot(st.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        # Base rows are masked out: their y is neither read nor written.
        ok = valid[:, None] & col_ok[None, :]
        dst = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        old = tl.load(dst, mask=ok, other=0.0).to(tl.float32)
        # The update rounded to y's dtype, then added (ops.add_lora's `y += delta.to(y.dtype)`).
        delta = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dst, (old + delta).to(y_ptr.dtype.element_ty), mask=ok)


# Fixed when the kernels were decorated (TRITON_INTERPRET=1 when triton was first imported).
_INTERPRETED = triton is not None and isinstance(_shrink_kernel, InterpretedFunction)


def interpreted() -> bool:
    """Whether Triton runs its interpreter here."""
    return _INTERPRETED


def available_for(x: torch.Tensor) -> bool:
    """Whether add_lora_triton takes x: a CUDA tensor, or any under the interpreter."""
    return triton is not None and (x.device.type == "cuda" or interpreted())


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_m(num_rows: int) -> int:
    """Rows a program covers: tl.dot needs at least 16; a decode step has few."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def _block_r(rank: int) -> int:
    return min(max(16, _next_pow2(rank)), 64)


def shrink_split_k(num_rows: int, in_features: int, rank: int) -> int:
    """Shares of the input features a shrink tile is cut into (a power of
    two): enough programs to spread a small step over the GPU, each share at
    least one BLOCK_K chunk. From the shapes alone, so a graph's launch stays fixed."""
    tiles = triton.cdiv(num_rows, _block_m(num_rows)) * triton.cdiv(rank, _block_r(rank))
    split = 1
    while tiles * split < _SHRINK_MIN_PROGRAMS and split < _MAX_SPLIT_K and 2 * split * BLOCK_K <= in_features:
        split *= 2
    return split


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: torch.Tensor,
    row_slots: torch.Tensor,
    out_offset: int = 0,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """y[rows, out_offset : out_offset + out] += scalings[slot] * (x[rows] @ lora_a[slot]) @ lora_b[slot]
    for each row whose row_slots entry is a slot, in place; returns y.

    x [T, in]; y [T, >= out_offset + out] (any strides); lora_a [slots, in, R];
    lora_b [slots, R, out]; scalings [slots] float32; row_slots [T] int32 or
    int64 on the device, each row's slot or NO_LORA (-1). split_k: the shrink's
    split of the input features (a power of two; default shrink_split_k's)."""
    if triton is None:
        raise RuntimeError("add_lora_triton needs the triton package (ops.add_lora serves without it)")
    out = lora_b.shape[2]
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != lora_a.shape[1]:
        raise ValueError(f"add_lora: x {tuple(x.shape)}, y {tuple(y.shape)} and A {tuple(lora_a.shape)} disagree")
    num_slots, in_features, rank = lora_a.shape
    if tuple(lora_b.shape[:2]) != (num_slots, rank) or tuple(scalings.shape) != (num_slots,):
        raise ValueError(
            f"add_lora: A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} and scalings {tuple(scalings.shape)} disagree"
        )
    if out_offset < 0 or out_offset + out > y.shape[1]:
        raise ValueError(f"add_lora: output columns {out_offset}..{out_offset + out} outside y's {y.shape[1]}")
    if row_slots.shape != (x.shape[0],) or row_slots.dtype not in _SLOT_DTYPES:
        raise ValueError(
            f"add_lora_triton: row_slots must be int32/int64 [{x.shape[0]}], not {row_slots.dtype} {tuple(row_slots.shape)}"
        )
    if scalings.dtype != torch.float32:
        raise ValueError(f"add_lora_triton: scalings must be float32, not {scalings.dtype}")
    devices = {t.device for t in (y, x, lora_a, lora_b, scalings, row_slots)}
    if len(devices) != 1:
        raise ValueError(f"add_lora_triton: every tensor must be on one device, not {sorted(map(str, devices))}")
    if not available_for(x):
        raise RuntimeError(
            "add_lora_triton needs CUDA tensors (on the CPU, only under TRITON_INTERPRET=1 "
            "set before triton is first imported)"
        )
    num_rows = x.shape[0]
    if num_rows == 0 or out == 0 or rank == 0 or num_slots == 0:
        return y
    if split_k is None:
        split_k = shrink_split_k(num_rows, in_features, rank)
    if split_k < 1 or split_k & (split_k - 1):
        raise ValueError(f"add_lora_triton: split_k must be a power of two, not {split_k}")
    block_m, block_r = _block_m(num_rows), _block_r(rank)
    # The interpreter's tl.dot multiplies bfloat16's raw bits: there the same
    # values (exact in float32) go through a float32 dot instead.
    upcast = interpreted() and torch.bfloat16 in (x.dtype, y.dtype)
    # Split shares add into it atomically: zeroed first (a memset, captured with the graph).
    scratch = (torch.zeros if split_k > 1 else torch.empty)(num_rows, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(rank, block_r), split_k)](
        scratch,
        x,
        lora_a,
        row_slots,
        scalings,
        num_rows,
        in_features,
        rank,
        num_slots,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        scratch.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
        SPLIT_K=split_k,
        NATIVE_DOT=x.dtype == lora_a.dtype and x.dtype in _NATIVE_DOT,
        UPCAST=upcast,
    )
    part = y.narrow(1, out_offset, out)  # a view: its data pointer starts at out_offset
    _expand_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(out, BLOCK_N))](
        part,
        scratch,
        lora_b,
        row_slots,
        num_rows,
        rank,
        out,
        num_slots,
        part.stride(0),
        part.stride(1),
        scratch.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
        NATIVE_DOT=y.dtype == lora_b.dtype and y.dtype in _NATIVE_DOT,
        UPCAST=upcast,
    )
    return y
