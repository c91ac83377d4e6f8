"""What the varlen backends (triton, flash_attn) share: their metadata, the
whole step as flat tensors that one kernel call per layer reads, prefill
chunks and decodes alike. The model runner stages them in its one host-to-device
copy (in a CUDA graph's static buffer for a replayed decode step), so
building the metadata copies nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from shoal.workers.model_executor.layers.attention.backends.abstract import CommonAttentionMetadata


@dataclass(slots=True)
class VarlenMetadata:
    """Sequence i owns queries query_start_loc[i]:query_start_loc[i + 1] of
    the flat batch, the last of its seq_lens[i] positions."""

    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    max_query_len: int  # sizes the launch grid without reading the device


class VarlenMetadataBuilder:
    def __init__(self, block_size: int, device: torch.device):
        pass  # the staged tensors say it all

    def build(self, common: CommonAttentionMetadata) -> VarlenMetadata:
        # the model runner stages the varlen tensors for a varlen backend
        return VarlenMetadata(
            slot_mapping=common.slot_mapping,
            block_tables=cast(torch.Tensor, common.block_table_tensor),
            seq_lens=cast(torch.Tensor, common.seq_lens),
            query_start_loc=cast(torch.Tensor, common.query_start_loc),
            max_query_len=common.max_query_len,
        )


class VarlenBackend:
    """Declares what a varlen backend has in common; each adds its name, impl and validate."""

    varlen = True
    uses_cpu_kernels = False
    supports_fp8_kv_cache = False  # flash-attn 2 reads 16-bit caches only
    metadata_cls = VarlenMetadata
    builder_cls = VarlenMetadataBuilder
