"""The compiled CPU backend (platforms/cpu/csrc/paged_decode_cpu.cpp), for float32
engines on the CPU: decodes read the paged cache directly, each key and
value once for all the query heads that share it, each context at its own
length (no padding, so one group and no mask), from the block of its
first key in the layer's sliding window where it has one. Prefill chunks
read the paged cache too (csrc/paged_prefill_cpu.cpp: query tiles against
key tiles with an online softmax, causal and windowed), a fresh prompt's
included, except a fresh prompt longer than PAGED_PREFILL_MAX_FRESH, where
torch's own flash attention over its contiguous keys measured faster.

Choosing it also brings the compiled matmul and small ops to the other
layers and the one-call decode step (platforms/cpu/: the model runner binds
them where a backend declares uses_cpu_kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionLayer, CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import (
    DecodeGroup,
    GatherWorkspace,
    PrefillChunk,
    decode_group,
    prefill_attention,
    prefill_chunks,
)
from shoal.workers.model_executor.platforms.cpu.kernels import load as load_cpu_kernels
from shoal.workers.profiling import step_range

REQUIREMENTS = "attention_backend='cpu_kernel' needs a CPU, float32, a C++ compiler and cpu_kernels on"
# A fresh prompt (no context before it) of more tokens than this takes torch's
# SDPA over its keys as they came; shorter ones, and every chunk after cached
# context (which torch gathers out of the cache and masks densely), the kernel.
PAGED_PREFILL_MAX_FRESH = 1024


@dataclass(slots=True)
class PagedPrefills:
    """The prefill chunks the compiled kernel runs, as it reads them: chunk c
    is rows query_starts[c] .. + query_lens[c] of the flat batch, the last of
    context_lens[c] positions (its own keys already in the cache)."""

    block_tables: torch.Tensor  # [chunks, max_blocks] int64, padded with 0
    query_starts: torch.Tensor  # [chunks] int64
    query_lens: torch.Tensor
    context_lens: torch.Tensor


def paged_prefills(
    common: CommonAttentionMetadata, chunks: list[PrefillChunk], block_size: int, device: torch.device
) -> tuple[PagedPrefills | None, list[PrefillChunk]]:
    """Splits the step's prefill chunks into those the kernel runs (as one
    PagedPrefills) and those left to the torch path."""
    rows, rest = [], []
    for i, p in zip(range(common.num_decodes, len(common.query_lens)), chunks):
        n = p.end - p.start
        if p.block_table is None and n > PAGED_PREFILL_MAX_FRESH:
            rest.append(p)
        else:
            rows.append((i, p))
    if not rows:
        return None, rest
    tables = [common.block_tables_cpu[i][: cdiv(p.context_len, block_size)] for i, p in rows]
    width = max(map(len, tables))
    meta = torch.tensor(
        [[p.start, p.end - p.start, p.context_len] + t + [0] * (width - len(t)) for (_, p), t in zip(rows, tables)],
        dtype=torch.int64,
        device=device,
    )
    paged = PagedPrefills(
        meta[:, 3:].contiguous(), meta[:, 0].contiguous(), meta[:, 1].contiguous(), meta[:, 2].contiguous()
    )
    return paged, rest


@dataclass(slots=True)
class CPUKernelMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    decode: DecodeGroup | None  # every decode of the step, None when it has none
    prefills: list[PrefillChunk]  # the chunks the torch path runs
    paged: PagedPrefills | None = None  # the chunks the compiled prefill kernel runs

    @property
    def decode_only(self) -> bool:
        """Every row of the step is a decode (what the one-call decode step runs)."""
        return self.decode is not None and not self.prefills and self.paged is None


class CPUKernelMetadataBuilder:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device

    def build(self, common: CommonAttentionMetadata) -> CPUKernelMetadata:
        chunks = prefill_chunks(common, self.block_size, self.device)
        decode = None
        if common.num_decodes:
            lens, tables = common.seq_lens_cpu, common.block_tables_cpu
            decode = decode_group(
                lens, tables, 0, common.num_decodes, self.block_size, self.device, False, None, common.block_tables_np
            )
        paged, chunks = paged_prefills(common, chunks, self.block_size, self.device)
        return CPUKernelMetadata(common.slot_mapping, decode, chunks, paged)


class CPUKernelImpl:
    def __init__(self):
        self.kernels = load_cpu_kernels()
        self.workspace = GatherWorkspace()  # prefill chunks after context gather their blocks

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: CPUKernelMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        g = metadata.decode
        if g is not None:
            with step_range("attention_decode"):
                out[g.start : g.end] = self.kernels.paged_decode_attention(
                    q[g.start : g.end],
                    layer.k_cache,
                    layer.v_cache,
                    g.block_tables,
                    g.context_lens,
                    layer.scale,
                    layer.sliding_window or 0,  # 0: no window
                )
        with step_range("attention_prefill"):
            self._prefill(layer, q, k, v, metadata, out)
        return out

    def _prefill(self, layer: AttentionLayer, q, k, v, metadata: CPUKernelMetadata, out: torch.Tensor) -> None:
        p = metadata.paged
        if p is not None:
            self.kernels.paged_prefill_attention(
                out,
                q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous(),
                layer.k_cache,
                layer.v_cache,
                p.block_tables,
                p.query_starts,
                p.query_lens,
                p.context_lens,
                layer.scale,
                layer.sliding_window or 0,
            )
        prefill_attention(self.workspace, layer, q, k, v, metadata.prefills, out)


class CPUKernelBackend:
    name = "cpu_kernel"
    varlen = False
    uses_cpu_kernels = True
    supports_fp8_kv_cache = False  # the compiled decode kernel reads float32 caches
    metadata_cls = CPUKernelMetadata
    builder_cls = CPUKernelMetadataBuilder
    impl_cls = CPUKernelImpl

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        if device.type != "cpu" or dtype != torch.float32 or load_cpu_kernels() is None:  # built once per process
            raise RuntimeError(REQUIREMENTS)
