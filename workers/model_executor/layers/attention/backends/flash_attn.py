"""The flash-attn backend: flash-attn 2's varlen kernel, for CUDA engines
that have the flash_attn package (`pip install shoal[flash]`).

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
- q and the caches must be float16 or bfloat16, head_dim at most 256;
- window_size=(left, right) lets the query at (bottom-right aligned)
  position i see keys [i - left, i + right]: a sliding window of W
  positions, the query's own included, is (W - 1, 0); (-1, -1) is none.

flash_attn is imported when the backend is validated or its impl built:
this module imports without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionLayer
from shoal.workers.model_executor.layers.attention.backends.varlen import VarlenBackend, VarlenMetadata

# flash-attn 2's paged KV cache takes only blocks of a multiple of this many slots.
PAGE_BLOCK_MULTIPLE = 256


def _import_flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:  # not installed, or built against another torch or CUDA
        raise RuntimeError(
            f"the flash_attn attention backend needs the flash_attn package (pip install 'shoal[flash]'): {e}"
        ) from e
    return flash_attn_varlen_func


class FlashAttentionImpl:
    def __init__(self):
        self.flash_attn_varlen_func = _import_flash_attn()

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: VarlenMetadata
    ) -> torch.Tensor:
        m = metadata
        # Key lengths as flash-attn wants them, summed on the device: no host
        # sync, so a decode step can be captured in a CUDA graph. The block
        # table's capacity bounds every sequence's keys without reading one.
        cu_seqlens_k = F.pad(m.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen_k = m.block_tables.shape[1] * layer.k_cache.shape[1]
        window = getattr(layer, "sliding_window", None)  # a stand-in layer may lack it
        return self.flash_attn_varlen_func(
            q,
            layer.k_cache,
            layer.v_cache,
            m.query_start_loc,
            cu_seqlens_k,
            m.max_query_len,
            max_seqlen_k,
            softmax_scale=layer.scale,
            causal=True,
            window_size=(window - 1, 0) if window else (-1, -1),
            block_table=m.block_tables,
        )


class FlashAttentionBackend(VarlenBackend):
    name = "flash_attn"
    impl_cls = FlashAttentionImpl

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend='flash_attn' needs float16 or bfloat16; got {dtype}")
        if device.type != "cuda":
            raise RuntimeError(f"the flash_attn attention backend needs CUDA; the engine is on {device}")
        if block_size % PAGE_BLOCK_MULTIPLE:
            raise ValueError(
                f"flash-attn's paged KV cache needs block_size a multiple of {PAGE_BLOCK_MULTIPLE}; got {block_size}"
            )
        _import_flash_attn()
