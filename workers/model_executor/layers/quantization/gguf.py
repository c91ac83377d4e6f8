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
matmul. On the CPU the compiled kernels (csrc/gguf_gemv.cpp for the
32-weight types, csrc/gguf_kquants.cpp for the K-quants) quantize each
activation row per block to 8 bits and take integer dot products, as
llama.cpp does; while they are bound, the 32-weight types are kept packed
in groups of 16 rows (set_packed; llama.cpp repacks its Q4_0 the same way
on AVX-512). Elsewhere the blocks are expanded per call (a reference, not
a fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.workers.model_executor.layers.cpu_linear import linear
from shoal.workers.model_executor.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    set_weight_attrs,
)

# ggml type -> (name, weights a block, bytes a block) of the types computed on their blocks
BLOCK_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
_KQUANTS = (12, 13, 14)
F32 = 0  # the type of a matrix kept in float


def type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
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
        if self.ggml_type not in BLOCK_TYPES:
            raise ValueError(
                f"GGUF type {type_name(self.ggml_type)} is not computed on its blocks; shoal computes "
                f"{', '.join(n for n, _, _ in BLOCK_TYPES.values())} (or --quantization none expands it)"
            )
        _, per, size = BLOCK_TYPES[self.ggml_type]
        if self.cols % per or self.data.shape[-1] != self.cols // per * size:
            raise ValueError(f"{type_name(self.ggml_type)} rows of {self.cols} columns are not whole blocks")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def block(self) -> tuple[int, int]:
        return BLOCK_TYPES[self.ggml_type][1:]

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


def dequantize(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """float32 [rows, cols] of uint8 block rows: in torch for the 32-weight
    types (an embedding lookup expands only its rows this way), through
    gguf's numpy code for the K-quants."""
    rows = data.shape[0]
    if ggml_type in (2, 3, 8):
        _, per, size = BLOCK_TYPES[ggml_type]
        b = data.reshape(rows, cols // per, size)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        if ggml_type == 8:
            return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, cols)
        qs = b[..., 4:] if ggml_type == 3 else b[..., 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # byte i: value i low, value 16 + i high
        if ggml_type == 2:
            return (d * (q - 8)).reshape(rows, cols)
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q + m).reshape(rows, cols)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(data.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(out.reshape(rows, cols)).to(data.device)


PACKED_TYPES = (2, 3, 8)  # kept packed for gguf_linear while the CPU kernels are bound


def set_packed(param: nn.Parameter, kernels) -> None:
    """Puts a GGUF weight's Q4_0 / Q4_1 / Q8_0 groups in the layout the
    bound CPU kernels multiply (kernels.gguf_pack: each 16 rows interleaved
    for vpdpbusd, the same bytes moved), or back as the file stores them
    when the kernels are unbound (None). A tied head's weight is the
    embedding's parameter: packed once."""
    groups = getattr(param, "gguf_groups", None)
    packed_by = getattr(param, "gguf_packed_by", None)
    if groups is None or packed_by is kernels:
        return
    new = []
    for t, data, cols in groups:
        if t in PACKED_TYPES and data.device.type == "cpu":
            if packed_by is not None:
                data = packed_by.gguf_pack(data, t, True)
            if kernels is not None:
                data = kernels.gguf_pack(data, t, False)
        new.append((t, data, cols))
    param.gguf_groups = new
    param.gguf_packed_by = kernels
    if len(new) == 1:
        param.data = new[0][1]


def block_matmul(x: torch.Tensor, data: torch.Tensor, ggml_type: int, cols: int, kernels) -> torch.Tensor:
    """x [M, cols] @ W^T for W's blocks, float32 out (the 32-weight types
    packed by set_packed when kernels is not None)."""
    if kernels is not None and x.device.type == "cpu":
        xf = x.float().contiguous()
        if ggml_type in _KQUANTS:
            return kernels.gguf_linear_k(xf, data, ggml_type, False)
        return kernels.gguf_linear(xf, data, ggml_type, False)
    return F.linear(x.float(), dequantize(data, ggml_type, cols))


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


def _finish(param: nn.Parameter, name: str) -> None:
    """Joins the stored parts into the parameter: one run of blocks when
    every part has the same type, groups of (type, rows) when not. Float
    parts stay float32 (GGUF is served on the CPU, in float32)."""
    parts: _Parts | None = getattr(param, "gguf_parts", None)
    if parts is None:  # a tied head's parameter, finished with the embedding
        return
    if any(p is None for p in parts.shards):
        raise ValueError(f"{name}: the checkpoint lacks a part of this weight")
    groups: list[tuple[int, torch.Tensor, int]] = []  # (ggml type, rows, columns), float as F32
    for p in parts.shards:
        t, data, cols = (p.ggml_type, p.data, p.cols) if isinstance(p, GGUFBlocks) else (F32, p, p.shape[1])
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
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
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
        for t, data, cols in layer.weight.gguf_groups:
            if t == F32:
                outs.append(linear(x2, data, None, layer.cpu_kernels))
            else:
                outs.append(block_matmul(x2, data, t, cols, layer.cpu_kernels).to(x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])


class GGUFEmbeddingMethod(GGUFLinearMethod):
    """The vocabulary rows: a lookup expands only the rows it reads (an
    embedding in Q8_0 stays Q8_0); the LM head multiplies on the blocks."""

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        ((t, data, cols),) = layer.weight.gguf_groups
        ids = input_ids.reshape(-1)
        packed_by = getattr(layer.weight, "gguf_packed_by", None)
        if t == F32:
            rows = F.embedding(ids, data)
        elif packed_by is not None and t in PACKED_TYPES:
            rows = dequantize(packed_by.gguf_packed_rows(data, ids, t), t, cols)
        else:
            rows = dequantize(data.index_select(0, ids), t, cols)
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
