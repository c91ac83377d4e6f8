"""Attention over the paged KV cache: the layer (layer.py), the per-step
context it reads its metadata from (forward_context.py), one module per
backend (backends/) and the selector that picks one at start (selector.py);
the Triton backend's kernels are triton_kernels.py."""

from shoal.workers.model_executor.layers.attention.forward_context import get_forward_context, set_forward_context
from shoal.workers.model_executor.layers.attention.layer import PagedAttention, write_to_paged_cache

__all__ = ["PagedAttention", "get_forward_context", "set_forward_context", "write_to_paged_cache"]
