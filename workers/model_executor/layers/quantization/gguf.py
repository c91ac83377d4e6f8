"""GGUF's own block types, kept as they are in the file and multiplied on
them (vLLM's GGUFConfig / GGUFLinearMethod): --quantization gguf.

A block-quantized matrix is stored row by row, each row a run of blocks of
32 or 256 weights along the input features. Rows are whole, so cutting
output rows (column-parallel layers, the vocabulary) is free; a
row-parallel layer cuts each row at a block boundary or not at all.

Each layer's weight is one parameter (a tied LM head shares it with the
embedding) whose data is the blocks as uint8 [rows, row bytes] and whose
`ggml_type` says what they hold. The parts of a fused layer (q, k, v;
gate, up) may come in different types (a Q4_K_M file keeps some in Q6_K):
those are kept as groups and multiplied one after the other. Matrices the
file holds in a float type are kept in float and take the unquantized
matmul. The blocks are multiplied by the CPU platform's GGUF block
kernels (platforms/cpu/gguf_blocks.py: integer dot products on the blocks
as llama.cpp takes them, while the compiled kernels are bound), elsewhere
expanded per call (a reference, not a fast path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.workers.model_executor.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    set_weight_attrs,
)
from shoal.workers.model_executor.platforms.cpu.matmul import linear


def _blocks() -> Any:
    """platforms/cpu/gguf_blocks.py, imported on first use: it needs the gguf
    package, which only a GGUF model does (a GPU machine may lack it)."""
    from shoal.workers.model_executor.platforms.cpu import gguf_blocks

    return gguf_blocks


def block_types() -> dict[int, tuple[str, int, int]]:
    """The GGUF types computed on their blocks: type -> (name, weights a block, bytes a block)."""
    return _blocks().BLOCK_TYPES


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


@dataclass
class GGUFBlocks:
    """A block-quantized checkpoint matrix on its way to a layer: `data` is
    uint8 [rows, row bytes]; `shape` is the matrix's (rows, columns), so the
    layers' loaders cut it as they cut a float tensor."""

    data: torch.Tensor
    ggml_type: int
    cols: int

    def __post_init__(self):
        block_types = _blocks().BLOCK_TYPES
        if self.ggml_type not in block_types:
            raise ValueError(
                f"GGUF type {type_name(self.ggml_type)} is not computed on its blocks; shoal computes "
                f"{', '.join(n for n, _, _ in block_types.values())} (or --quantization none expands it)"
            )
        _, per, size = block_types[self.ggml_type]
        if self.cols % per or self.data.shape[-1] != self.cols // per * size:
            raise ValueError(f"{type_name(self.ggml_type)} rows of {self.cols} columns are not whole blocks")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def block(self) -> tuple[int, int]:
        return _blocks().BLOCK_TYPES[self.ggml_type][1:]

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.data.narrow(0, start, length), self.ggml_type, self.cols)
        per, size = self.block
        if start % per or length % per:
            raise ValueError(
                f"tensor parallelism would cut {type_name(self.ggml_type)} blocks of {per} columns "
                f"(this rank's columns {start}..{start + length} of {self.cols}): choose a tensor-parallel "
                f"size that divides the input features into whole blocks, or --quantization none"
            )
        return GGUFBlocks(self.data.narrow(1, start // per * size, length // per * size), self.ggml_type, length)

    def __getitem__(self, rows: slice) -> GGUFBlocks:
        return GGUFBlocks(self.data[rows], self.ggml_type, self.cols)

    def split(self, sizes: list[int], dim: int = 0) -> list[GGUFBlocks]:
        if dim != 0:
            raise ValueError("GGUF blocks split by rows only")
        return [GGUFBlocks(d, self.ggml_type, self.cols) for d in self.data.split(sizes, 0)]


class _Parts:
    """What the loader has stored of one weight, by shard, until process_weights_after_loading."""

    def __init__(self, num_shards: int):
        self.shards: list[GGUFBlocks | torch.Tensor | None] = [None] * num_shards

    def store(self, shard_id: int | None, part, total_rows: int | None = None) -> None:
        if isinstance(part, GGUFBlocks) and total_rows is not None and total_rows > part.shape[0]:
            pad = part.data.new_zeros(total_rows - part.shape[0], part.data.shape[1])  # zero blocks: zeros
            part = GGUFBlocks(torch.cat([part.data, pad]), part.ggml_type, part.cols)
        elif isinstance(part, torch.Tensor):
            part = part.float()
            if total_rows is not None and total_rows > part.shape[0]:
                part = torch.cat([part, part.new_zeros(total_rows - part.shape[0], part.shape[1])])
        self.shards[shard_id or 0] = part.clone() if isinstance(part, torch.Tensor) else _own(part)


def _own(b: GGUFBlocks) -> GGUFBlocks:
    """A contiguous copy: the loader's blocks may be views of a memory-mapped file."""
    return GGUFBlocks(b.data.contiguous().clone(), b.ggml_type, b.cols)


def _finish(param: Any, name: str) -> None:
    """Joins the stored parts into the parameter: one run of blocks when
    every part has the same type, groups of (type, rows) when not. Float
    parts stay float32 (GGUF is served on the CPU, in float32)."""
    parts: _Parts | None = getattr(param, "gguf_parts", None)
    if parts is None:  # a tied head's parameter, finished with the embedding
        return
    if any(p is None for p in parts.shards):
        raise ValueError(f"{name}: the checkpoint lacks a part of this weight")
    groups: list[tuple[int, torch.Tensor, int]] = []  # (ggml type, rows, columns), float as F32
    f32 = _blocks().F32
    for p in cast("list[GGUFBlocks | torch.Tensor]", parts.shards):  # none missing: checked above
        t, data, cols = (p.ggml_type, p.data, p.cols) if isinstance(p, GGUFBlocks) else (f32, p, p.shape[1])
        if groups and groups[-1][0] == t:
            groups[-1] = (t, torch.cat([groups[-1][1], data]), cols)
        else:
            groups.append((t, data, cols))
    param.gguf_parts = None
    param.gguf_groups = groups
    param.data = groups[0][1] if len(groups) == 1 else torch.empty(0, dtype=torch.uint8)
    param.ggml_type = groups[0][0] if len(groups) == 1 else -1


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer on the file's blocks (or float, where the file keeps it so)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        weight: Any = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)  # with attributes of its own
        set_weight_attrs(weight, extra_weight_attrs)
        weight.gguf_parts = _Parts(len(output_partition_sizes))
        weight.store_part = weight.gguf_parts.store
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _finish(layer.weight, type(layer).__name__)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        outs = []
        weight: Any = layer.weight  # a Parameter with gguf_groups (_finish)
        blocks = _blocks()
        for t, data, cols in weight.gguf_groups:
            if t == blocks.F32:
                outs.append(linear(x2, data, None, layer.cpu_kernels))
            else:
                outs.append(blocks.block_matmul(x2, data, t, cols, layer.cpu_kernels).to(x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """The vocabulary rows: a lookup expands only the rows it reads (an
    embedding in Q8_0 stays Q8_0); the LM head multiplies on the blocks."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        weight: Any = layer.weight  # a Parameter with gguf_groups (_finish)
        ((t, data, cols),) = weight.gguf_groups
        ids = input_ids.reshape(-1)
        packed_by = getattr(layer.weight, "gguf_packed_by", None)
        blocks = _blocks()
        if t == blocks.F32:
            rows = F.embedding(ids, data)
        elif packed_by is not None and t in blocks.PACKED_TYPES:
            rows = blocks.dequantize(packed_by.gguf_packed_rows(data, ids, t), t, cols)
        else:
            rows = blocks.dequantize(data.index_select(0, ids), t, cols)
        return rows.reshape(*input_ids.shape, cols)


class GGUFConfig(QuantizationConfig):
    """Every linear layer, the embedding and the LM head on the file's blocks;
    the experts of a mixture (and the norms) expanded to float by the loader."""

    def get_name(self) -> str:
        return "gguf"

    @classmethod
    def from_config(cls, config: dict) -> GGUFConfig:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from shoal.workers.model_executor.layers.linear import LinearBase
        from shoal.workers.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod()
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        return None


def keeps_blocks(hf_name: str) -> bool:
    """Whether the GGUF loader hands this checkpoint tensor over as blocks
    under --quantization gguf: the weights of the layers GGUFConfig gives a
    method (experts and norms come expanded)."""
    if not hf_name.endswith(".weight") or ".experts." in hf_name:
        return False
    return hf_name.endswith("_proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")
