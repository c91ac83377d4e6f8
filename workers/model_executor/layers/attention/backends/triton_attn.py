"""The Triton backend: paged attention for the whole step in one launch per
layer (the kernels: layers/attention/triton_kernels.py). `auto` picks it on CUDA;
off CUDA it runs only under Triton's interpreter (the tests).

Triton is imported when the backend is validated or its impl built, not
with this module: TRITON_INTERPRET must be set before the kernels are
first imported, and engines on other backends never load Triton.
"""

from __future__ import annotations

import torch

from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionLayer
from shoal.workers.model_executor.layers.attention.backends.varlen import VarlenBackend, VarlenMetadata
from shoal.workers.model_executor.layers.attention.kv_cache import layer_scales


class TritonAttentionImpl:
    def __init__(self):
        from shoal.workers.model_executor.layers.attention import triton_kernels

        self.paged_attention = triton_kernels.paged_attention

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: VarlenMetadata
    ) -> torch.Tensor:
        m = metadata
        k_scale, v_scale = layer_scales(layer)
        return self.paged_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            m.block_tables,
            m.seq_lens,
            m.query_start_loc,
            m.max_query_len,
            layer.scale,
            sliding_window=layer.sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
        )


class TritonAttentionBackend(VarlenBackend):
    name = "triton"
    supports_fp8_kv_cache = True
    impl_cls = TritonAttentionImpl

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        from shoal.workers.model_executor.layers.attention import triton_kernels

        triton_kernels.load(device, block_size)  # raises where the kernel cannot run
