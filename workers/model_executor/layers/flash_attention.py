"""Paged attention through flash-attn 2's varlen kernel, for CUDA engines
that have the flash_attn package (`pip install shoal[flash]`).

The callable `load` returns takes and returns exactly what
triton_attention.paged_attention does, so the model runner can use either.
flash_attn_varlen_func reads keys and values straight from the paged cache
through its `block_table` argument (upstream since Dao-AILab/flash-attention
PR #831, March 2024). The facts this relies on, from upstream's
flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp:
- with causal=True the mask is aligned to the bottom right, so a chunk of q
  new tokens after cached context sees all the context and itself causally,
  as the engine's other backends do;
- the paged cache's block size must be divisible by 256 (mha_varlen_fwd
  checks it), so an engine on this backend needs block_size 256 or a
  multiple;
- q and the caches must be float16 or bfloat16, head_dim at most 256.

flash_attn is imported inside `load`: this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# flash-attn 2's paged KV cache takes only blocks of a multiple of this many slots.
PAGE_BLOCK_MULTIPLE = 256


def load(device: torch.device, block_size: int) -> Callable[..., torch.Tensor]:
    """paged_attention for an engine on `device`; raises when it cannot run there."""
    if device.type != "cuda":
        raise RuntimeError(f"the flash_attn attention backend needs CUDA; the engine is on {device}")
    if block_size % PAGE_BLOCK_MULTIPLE:
        raise ValueError(
            f"flash-attn's paged KV cache needs block_size a multiple of {PAGE_BLOCK_MULTIPLE}; got {block_size}"
        )
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:  # not installed, or built against another torch or CUDA
        raise RuntimeError(
            f"the flash_attn attention backend needs the flash_attn package (pip install 'shoal[flash]'): {e}"
        ) from e

    def paged_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        scale: float,
    ) -> torch.Tensor:
        """q [T, heads, dim]; caches [num_blocks, block_size, kv_heads, dim];
        sequence i owns queries query_start_loc[i]:query_start_loc[i + 1], the
        last of its seq_lens[i] positions. Returns [T, heads, dim]."""
        # Key lengths as flash-attn wants them, summed on the device: no host
        # sync, so a decode step can be captured in a CUDA graph. The block
        # table's capacity bounds every sequence's keys without reading one.
        cu_seqlens_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen_k = block_tables.shape[1] * k_cache.shape[1]
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            query_start_loc,
            cu_seqlens_k,
            max_query_len,
            max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=block_tables,
        )

    return paged_attention
