"""The attention layer over the paged KV cache. It writes the step's keys
and values into the cache, then hands the attention itself to its
backend's impl (backends/), which the model runner binds."""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionImpl
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPAImpl
from shoal.workers.model_executor.layers.attention.forward_context import get_forward_context, get_kv_connector
from shoal.workers.model_executor.layers.attention.kv_cache import is_fp8, quantize_fp8


def write_to_paged_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, kv_heads, dim] go to flat slots `slot_mapping` of the
    caches [num_blocks, block_size, kv_heads, dim]; every backend reads them
    there. An fp8 cache stores them divided by k_scale / v_scale (kv_cache.py)."""
    if is_fp8(k_cache):
        # index_copy_ has no float8 kernel on the CPU: copy the bytes.
        key, value = quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


class PagedAttention(nn.Module):
    """The cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim];
    viewed flat, slot s is block s // block_size, offset s % block_size."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
    ):
        """scale: of q.k (head_dim ** -0.5 unless the model says otherwise);
        sliding_window: a query attends to this many most recent positions,
        itself included (None: all of them)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        # Per-tensor scales of an fp8 cache (vLLM's names): stored = k / k_scale.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.impl: AttentionImpl = TorchSDPAImpl()  # the reference, until the model runner binds its backend's
        self.layer_name = ""  # its module path in the model, set with its cache (a KV connector's hooks name it)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [T, heads * dim]."""
        meta = get_forward_context()
        connector = get_kv_connector()
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        write_to_paged_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.impl.forward(self, q, k, v, meta).view(q.shape[0], -1)
        if connector is not None:
            connector.save_kv_layer(self.layer_name, (self.k_cache, self.v_cache), meta)
        return out
