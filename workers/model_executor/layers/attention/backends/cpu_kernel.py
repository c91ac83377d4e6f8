"""The compiled CPU backend (layers/csrc/paged_decode_cpu.cpp), for float32
engines on the CPU: decodes read the paged cache directly, each key and
value once for all the query heads that share it, each context at its own
length (no padding, so one group and no mask), from the block of its
first key in the layer's sliding window where it has one. Prefill chunks
take the torch backend's path.

Choosing it also brings the compiled matmul and small ops to the other
layers and the one-call decode step (model_executor/cpu_decode_step.py),
through `cpu_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionLayer, CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import (
    DecodeGroup,
    GatherWorkspace,
    PrefillChunk,
    decode_group,
    prefill_attention,
    prefill_chunks,
)
from shoal.workers.model_executor.layers.cpu_kernels import load as load_cpu_kernels

REQUIREMENTS = "attention_backend='cpu_kernel' needs a CPU, float32, a C++ compiler and cpu_kernels on"


@dataclass(slots=True)
class CPUKernelMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    decode: DecodeGroup | None  # every decode of the step, None when it has none
    prefills: list[PrefillChunk]

    @property
    def decode_only(self) -> bool:
        """Every row of the step is a decode (what the one-call decode step runs)."""
        return self.decode is not None and not self.prefills


class CPUKernelMetadataBuilder:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device

    def build(self, common: CommonAttentionMetadata) -> CPUKernelMetadata:
        chunks = prefill_chunks(common, self.block_size, self.device)
        decode = None
        if common.num_decodes:
            lens, tables = common.seq_lens_cpu, common.block_tables_cpu
            decode = decode_group(lens, tables, 0, common.num_decodes, self.block_size, self.device, masked=False)
        return CPUKernelMetadata(common.slot_mapping, decode, chunks)


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
            out[g.start : g.end] = self.kernels.paged_decode_attention(
                q[g.start : g.end],
                layer.k_cache,
                layer.v_cache,
                g.block_tables,
                g.context_lens,
                layer.scale,
                layer.sliding_window or 0,  # 0: no window
            )
        prefill_attention(self.workspace, layer, q, k, v, metadata.prefills, out)
        return out


class CPUKernelBackend:
    name = "cpu_kernel"
    varlen = False
    supports_fp8_kv_cache = False  # the compiled decode kernel reads float32 caches
    metadata_cls = CPUKernelMetadata
    builder_cls = CPUKernelMetadataBuilder
    impl_cls = CPUKernelImpl

    @property
    def cpu_kernels(self):
        return load_cpu_kernels()  # built once per process

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        if device.type != "cpu" or dtype != torch.float32 or self.cpu_kernels is None:
            raise RuntimeError(REQUIREMENTS)
