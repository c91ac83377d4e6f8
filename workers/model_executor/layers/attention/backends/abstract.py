"""What every attention backend is (vLLM v1's AttentionBackend, reduced).

A backend is three things: its metadata (what its kernels read about the
step, built once per step and shared by every layer), its builder (which
makes that metadata from the step the model runner staged) and its impl
(the attention itself, called by each PagedAttention layer after the
step's keys and values are in the cache). A backend declares the three
classes and checks where it can run. The selector (../selector.py) picks
one at start; the model runner and the layers then only use what it
declares, so nothing else branches on which backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One step as the model runner staged it, for any backend's builder.

    Rows are the (sequence, new tokens) pairs of the flat batch, in its
    order: the one-token rows (decodes) first, longest context first. The
    host lists are empty where no row is known (a CUDA graph's capture);
    the varlen tensors are staged only for a varlen backend."""

    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    max_query_len: int
    num_decodes: int = 0  # rows [0, num_decodes) bring one token each
    query_lens: list[int] = field(default_factory=list)  # new tokens a row
    seq_lens_cpu: list[int] = field(default_factory=list)  # a row's context after the step
    block_tables_cpu: list[list[int]] = field(default_factory=list)  # a row's block ids
    # The same as one int64 array [rows, blocks of the longest row], 0 past a table's end
    # (the model runner's InputBatch rows): decodes take theirs with no Python work a row.
    block_tables_np: np.ndarray | None = None
    # varlen only: [num_rows, max_blocks] padded, [num_rows], [num_rows + 1]
    block_table_tensor: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None


class AttentionLayer(Protocol):
    """What an impl reads of the layer calling it (layer.py's PagedAttention)."""

    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, dim]
    v_cache: torch.Tensor
    scale: float
    # An fp8 cache's per-tensor scales: stored = k / k_scale (1.0 otherwise, unread).
    k_scale: float
    v_scale: float
    # A query at position p attends to keys p - sliding_window < k <= p (None: all k <= p).
    sliding_window: int | None


class AttentionMetadataBuilder(Protocol):
    """Built once per engine as builder_cls(block_size, device)."""

    def __init__(self, block_size: int, device: torch.device) -> None: ...

    def build(self, common: CommonAttentionMetadata) -> Any:
        """The step's metadata, an instance of the backend's metadata class
        (which always carries slot_mapping)."""
        ...


class AttentionImpl(Protocol):
    """Built as impl_cls() whenever the runner binds a new KV cache; one
    instance serves every layer."""

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] (already in the cache)
        -> [T, heads, dim]."""
        ...


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention backend (backends/*.py), as the selector returns it:
    what it is, declared, and the one check it makes."""

    name: str  # as EngineArgs.attention_backend spells it
    # The step's inputs as varlen tensors (block tables, sequence lengths,
    # query offsets) that one kernel call per layer reads: a layout CUDA
    # graphs can replay, with a spare KV block for the padding rows.
    varlen: bool
    # Runs on the compiled CPU kernels (platforms/cpu/), which the model
    # runner then binds to the other layers too (platforms/cpu/bind.py);
    # only cpu_kernel does.
    uses_cpu_kernels: bool
    # Reads and writes a float8_e4m3fn cache with per-tensor scales
    # (--kv-cache-dtype fp8, attention/kv_cache.py).
    supports_fp8_kv_cache: bool
    metadata_cls: type  # what its builder builds
    builder_cls: type[AttentionMetadataBuilder]
    impl_cls: type[AttentionImpl]

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        """Raises, saying why, when the backend cannot run an engine so configured."""
        ...
