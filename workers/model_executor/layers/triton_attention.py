"""Paged attention in Triton: prefill chunks and decodes in one launch.

Each program takes one sequence, one KV head and a tile of its new tokens;
its rows are (token, query head of the KV head's GQA group) pairs, so a key
block is loaded once for the whole group. Keys and values are read straight
from the paged cache through the block table, with an online softmax.

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


# block_tables' row stride changes with the step's longest context: left
# unspecialized so it does not cost a recompile.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the step's longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # keys before this chunk, all visible to it

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_pos = q_tile * BLOCK_Q + rows // GROUP_PAD  # token within the chunk
    head = kv_head * QUERIES_PER_KV + rows % GROUP_PAD
    row_ok = (q_pos < q_len) & (rows % GROUP_PAD < QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (q_start + q_pos).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

    # Causal: the token at chunk position p sees keys [0, cached + p].
    visible = cached + q_pos + 1
    # Keys the tile's last token sees; every row sees key 0, so no row's
    # running max stays -inf after the first block.
    num_keys = tl.minimum(seq_len, cached + (q_tile + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(num_keys, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + offsets
        key_ok = key_pos < num_keys
        k_off = block * stride_kb + offsets[None, :] * stride_ks + kv_head * stride_kh + dims[:, None]
        k = tl.load(k_cache_ptr + k_off, mask=dim_ok[:, None] & key_ok[None, :], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [rows, BLOCK_SIZE]
        s = tl.where(key_pos[None, :] < visible[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v_off = block * stride_vb + offsets[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_off = (q_start + q_pos).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_off, out, mask=row_ok[:, None] & dim_ok[None, :])


def load(device: torch.device, block_size: int) -> Callable[..., torch.Tensor]:
    """paged_attention for an engine on `device`; raises when it cannot run there."""
    _check_runs_on(device)
    _check_block_size(block_size)
    return paged_attention


def _check_runs_on(device: torch.device) -> None:
    if device.type != "cuda" and not isinstance(_paged_attention_kernel, InterpretedFunction):
        raise RuntimeError("the Triton attention kernel needs CUDA (on the CPU, only under TRITON_INTERPRET=1 "
                           "set before triton_attention is first imported, as the tests do)")  # fmt: skip


def _check_block_size(block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton attention kernel needs block_size a power of two >= 16; got {block_size}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                    scale: float) -> torch.Tensor:  # fmt: skip
    """q [T, heads, dim]; caches [num_blocks, block_size, kv_heads, dim];
    sequence i owns queries query_start_loc[i]:query_start_loc[i + 1], the
    last of its seq_lens[i] positions. Returns [T, heads, dim]."""
    _check_runs_on(q.device)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    _check_block_size(block_size)
    inner_strides = (q.stride(2), k_cache.stride(3), v_cache.stride(3), block_tables.stride(1))
    assert inner_strides == (1, 1, 1, 1), "head_dim and block tables must be contiguous"
    queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(queries_per_kv)
    block_q = max(MIN_BLOCK_M, group_pad) // group_pad
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    # The interpreter multiplies bfloat16 as raw integers; float32 holds
    # bfloat16 exactly, so upcasting there changes only the speed.
    dot_dtype = tl.float32 if interpreted and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        # float32 exactly (not TF32) where the inputs are float32; Triton's
        # default for 16-bit inputs, where the precision setting does not apply.
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )  # fmt: skip
    return out
