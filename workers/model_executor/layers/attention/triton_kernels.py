"""Paged attention in Triton: prefill chunks and decodes in one launch.

Each program takes one sequence, one KV head and a tile of its new tokens;
its rows are (token, query head of the KV head's GQA group) pairs, so a key
block is loaded once for the whole group. Keys and values are read straight
from the paged cache through the block table, with an online softmax.

A decode-only step with few sequences has too few such programs to fill a
GPU, so it takes a split-KV launch instead (vLLM's "3D" variant): each
sequence's key blocks are cut into NUM_SEGMENTS runs, one program a
(sequence, KV head, segment), each leaving a partial softmax (its max, its
sum and its unnormalised output) in float32 scratch; a second small kernel
merges the segments. Which launch, and every grid size, follows from tensor
shapes and max_query_len alone, never from tensor values, so a decode step
can be captured in a CUDA graph.

An fp8 cache (float8_e4m3fn, layers/attention/kv_cache.py) is read as
vLLM's Triton kernels read it: each key and value widened to float32, times
its cache's per-tensor scale, then cast to the dot's dtype.

A sliding window W (a layer's; NO_WINDOW, beyond any context, for none)
lets the query at position p see keys p - W < k <= p. A program starts its
walk at the block of the first key its first query sees, so a decode reads
about W keys however long its context; the split-KV launch cuts only those
blocks into segments, and its merge reckons them the same way.

Triton decides at decoration time whether a kernel is compiled or
interpreted, so TRITON_INTERPRET=1 must be set before this module is first
imported for it to run on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Rows per program: the minimum tl.dot takes, grown to fit a GQA group.
MIN_BLOCK_M = 16
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Key segments per sequence in the split-KV launch, as vLLM has it. Each
# covers cdiv(cdiv(seq_len, block_size), NUM_SEGMENTS) blocks, so a sequence
# of fewer blocks than segments leaves its trailing segments empty.
NUM_SEGMENTS = 16
# A decode step's single launch has one program per (sequence, KV head), each
# walking its whole context alone. An H100/H200 has 132 SMs, each able to run
# several programs at once: with fewer than about four programs an SM, most
# of the GPU waits on a few programs' serial walks, so such a step takes the
# split-KV launch. Larger steps fill the GPU as they are, and splitting them
# would only add the partials' traffic and a second launch. (vLLM cuts at 128
# programs; neither number is tuned on this engine yet.)
SPLIT_KV_MAX_PROGRAMS = 4 * 132
# The window the kernels take for full attention: wider than any context,
# and small enough that positions minus it stay within int32.
NO_WINDOW = 1 << 30


# block_tables' row stride changes with the step's longest context, and
# the window with the layer: left unspecialized so neither costs a recompile.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _paged_attention_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    k_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """NUM_SEGMENTS == 1: the grid's third axis tiles each chunk's queries and
    the program writes its rows of `out`. Otherwise (split KV, one query token
    a sequence) it picks a segment of the sequence's key blocks, and the
    program writes its partial softmax to part_* [tokens, heads,
    NUM_SEGMENTS(, HEAD_DIM_PAD)]; an empty segment writes nothing."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # (a + b - 1) // b rather than tl.cdiv, tl.full rather than tl.zeros: the
    # same code, but the interpreter pays milliseconds for every call of a
    # nested jit function.
    if NUM_SEGMENTS == 1:
        q_tile = tl.program_id(2)
    else:
        # Split KV: the one query token sees the keys of blocks [window_block,
        # num_blocks); this program takes the segment-th run of per_segment of them.
        q_tile = 0
        segment = tl.program_id(2)
        num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        window_block = tl.maximum(seq_len - window, 0) // BLOCK_SIZE
        # as _merge_segments_kernel reckons it
        per_segment = (num_blocks - window_block + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        split_block = window_block + segment * per_segment
        if split_block >= num_blocks:  # a short sequence's trailing segments: the merge skips them
            return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the step's longest chunk
        return
    cached = seq_len - q_len  # keys before this chunk
    # Keys the tile's last token sees.
    num_keys = tl.minimum(seq_len, cached + (q_tile + 1) * BLOCK_Q)
    end_block = (num_keys + BLOCK_SIZE - 1) // BLOCK_SIZE
    if NUM_SEGMENTS == 1:
        # From the block of the first key the tile's first token sees.
        first_block = tl.maximum(cached + q_tile * BLOCK_Q - window + 1, 0) // BLOCK_SIZE
    else:
        first_block = split_block
        end_block = tl.minimum(first_block + per_segment, end_block)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_pos = q_tile * BLOCK_Q + rows // GROUP_PAD  # token within the chunk
    head = kv_head * QUERIES_PER_KV + rows % GROUP_PAD
    row_ok = (q_pos < q_len) & (rows % GROUP_PAD < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

    # Causal, windowed: the token at chunk position p sees keys
    # [cached + p - window + 1, cached + p].
    visible = cached + q_pos + 1
    lowest = visible - window
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for j in range(first_block, end_block):
        block = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + offsets
        key_ok = key_pos < num_keys
        k_off = block * stride_kb + offsets[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        k = tl.load(k_cache_ptr + k_off, mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        if KV_FP8:
            k = k.to(tl.float32) * k_scale
        k = k.to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [rows, BLOCK_SIZE]
        seen = (key_pos[None, :] < visible[:, None]) & (key_pos[None, :] >= lowest[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet (a later token of a windowed tile,
        # whose window starts past this block) keeps m = -inf: subtract 0
        # there, so its p and alpha are 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v_off = block * stride_vb + offsets[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        if KV_FP8:
            v = v.to(tl.float32) * v_scale
        v = v.to(DOT_DTYPE)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_off, out, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # Unnormalised: the merge rescales and divides once.
        part = (token * (QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SEGMENTS + segment
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["window"])
def _merge_segments_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    window,
    stride_ot,
    stride_oh,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One program per (sequence, KV head) of a split-KV decode step, the
    group's query heads as rows: the partial softmaxes of the segments that
    hold keys, each rescaled by exp(m - the largest m), summed and
    normalised once. Segments past the sequence's blocks were never written
    and are not read; those read each hold a key, so every m is finite and
    nothing is NaN."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == token:  # no query token
        return
    # A query token makes seq_len >= 1, so per_segment >= 1. Under a window
    # the segments cut only the blocks from the window's first.
    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE - tl.maximum(seq_len - window, 0) // BLOCK_SIZE
    per_segment = (num_blocks + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    num_written = (num_blocks + per_segment - 1) // per_segment
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * QUERIES_PER_KV + rows
    row_ok = rows < QUERIES_PER_KV
    part = (token.to(tl.int64) * (QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SEGMENTS  # segment 0
    dims = tl.arange(0, HEAD_DIM_PAD)
    # Loops of elementwise steps, not tl.max/tl.sum over a tile of segments:
    # they visit only the written segments.
    m_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for segment in range(0, num_written):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + part + segment, mask=row_ok, other=0.0))
    l_sum = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)
    for segment in range(0, num_written):
        weight = tl.exp(tl.load(part_m_ptr + part + segment, mask=row_ok, other=0.0) - m_max)
        l_sum += tl.load(part_l_ptr + part + segment, mask=row_ok, other=1.0) * weight  # padding rows: no 0 / 0
        acc_off = (part + segment)[:, None] * HEAD_DIM_PAD + dims[None, :]
        acc += tl.load(part_acc_ptr + acc_off, mask=row_ok[:, None], other=0.0) * weight[:, None]
    out_off = token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out = (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_off, out, mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


def load(device: torch.device, block_size: int) -> Callable[..., torch.Tensor]:
    """paged_attention for an engine on `device`; raises when it cannot run there."""
    _check_runs_on(device)
    _check_block_size(block_size)
    return paged_attention


def _check_runs_on(device: torch.device) -> None:
    if device.type != "cuda" and not isinstance(_paged_attention_kernel, InterpretedFunction):
        raise RuntimeError(
            "the Triton attention kernel needs CUDA (on the CPU, only under TRITON_INTERPRET=1 "
            "set before attention/triton_kernels.py is first imported, as the tests do)"
        )


def _check_block_size(block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton attention kernel needs block_size a power of two >= 16; got {block_size}")


def use_split_kv(num_seqs: int, num_kv_heads: int, max_query_len: int) -> bool:
    """Whether a step takes the split-KV launch: decodes only (one query token
    a sequence), too few of them to fill the GPU one program a (sequence, KV
    head). Host ints only, so the choice is fixed for a captured graph."""
    return max_query_len == 1 and num_seqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    split_kv: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, heads, dim]; caches [num_blocks, block_size, kv_heads, dim];
    sequence i owns queries query_start_loc[i]:query_start_loc[i + 1], the
    last of its seq_lens[i] positions. Returns [T, heads, dim].

    sliding_window: the query at position p sees only keys p - sliding_window
    < k <= p (None or 0: every k <= p). split_kv forces the launch (True
    needs max_query_len == 1); None picks it by use_split_kv. k_scale,
    v_scale: an fp8 cache's per-tensor scales (stored = k / k_scale); a
    cache of q's dtype ignores them."""
    _check_runs_on(q.device)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    _check_block_size(block_size)
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if k_cache.dtype != v_cache.dtype or not (kv_fp8 or k_cache.dtype == q.dtype):
        raise ValueError(f"the KV cache must be float8_e4m3fn or q's {q.dtype}; got {k_cache.dtype}, {v_cache.dtype}")
    inner_strides = (q.stride(2), k_cache.stride(3), v_cache.stride(3), block_tables.stride(1))
    assert inner_strides == (1, 1, 1, 1), "head_dim and block tables must be contiguous"
    num_seqs = seq_lens.shape[0]
    if split_kv is None:
        split_kv = use_split_kv(num_seqs, num_kv_heads, max_query_len)
    assert not split_kv or max_query_len == 1, "the split-KV launch takes one query token a sequence"
    queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(queries_per_kv)
    block_q = max(MIN_BLOCK_M, group_pad) // group_pad
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    # The interpreter multiplies bfloat16 as raw integers; float32 holds
    # bfloat16 exactly, so upcasting there changes only the speed.
    dot_dtype = tl.float32 if interpreted and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    out = torch.empty_like(q)
    window = sliding_window or NO_WINDOW
    if split_kv:
        num_segments = NUM_SEGMENTS
        grid = (num_seqs, num_kv_heads, num_segments)
        # Only the segments that hold keys are written, and only those read.
        part_m = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, head_dim_pad, dtype=torch.float32, device=q.device)
    else:
        num_segments = 1
        grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
        part_m = part_l = part_acc = out  # not read or written
    _paged_attention_kernel[grid](
        out,
        part_m,
        part_l,
        part_acc,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        float(k_scale),
        float(v_scale),
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        NUM_SEGMENTS=num_segments,
        # float32 exactly (not TF32) where the inputs are float32; Triton's
        # default for 16-bit inputs, where the precision setting does not apply.
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        KV_FP8=kv_fp8,
    )
    if split_kv:
        _merge_segments_kernel[(num_seqs, num_kv_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            seq_lens,
            query_start_loc,
            window,
            out.stride(0),
            out.stride(1),
            QUERIES_PER_KV=queries_per_kv,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            NUM_SEGMENTS=num_segments,
        )
    return out
