"""The GGUF block kernels' Python side: which ggml types the compiled
kernels multiply on their blocks, the blocks' layout while the kernels are
bound, the matmul on them and its torch reference (dequantize).

The 32-weight types (csrc/gguf_gemv.cpp) and the K-quants
(csrc/gguf_kquants.cpp) quantize each activation row per block to 8 bits
and take integer dot products, as llama.cpp does; while the kernels are
bound, the 32-weight types are kept packed in groups of 16 rows
(set_packed; llama.cpp repacks its Q4_0 the same way on AVX-512). Without
them the blocks are expanded per call (a reference, not a fast path).
Type numbers and block sizes come from gguf's own tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

F32 = GGMLQuantizationType.F32  # the type of a matrix kept in float
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# ggml type -> (name, weights a block, bytes a block) of the types computed on their blocks
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {t: (t.name, *GGML_QUANT_SIZES[t]) for t in (Q4_0, Q4_1, Q8_0, *KQUANTS)}
PACKED_TYPES = (Q4_0, Q4_1, Q8_0)  # kept packed for gguf_linear while the CPU kernels are bound


def dequantize(data: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """float32 [rows, cols] of uint8 block rows: in torch for the 32-weight
    types (an embedding lookup expands only its rows this way), through
    gguf's numpy code for the K-quants."""
    rows = data.shape[0]
    if ggml_type in (Q4_0, Q4_1, Q8_0):
        _, per, size = BLOCK_TYPES[ggml_type]
        b = data.reshape(rows, cols // per, size)
        d = b[..., 0:2].contiguous().view(torch.float16).float()
        if ggml_type == Q8_0:
            return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, cols)
        qs = b[..., 4:] if ggml_type == Q4_1 else b[..., 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # byte i: value i low, value 16 + i high
        if ggml_type == Q4_0:
            return (d * (q - 8)).reshape(rows, cols)
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        return (d * q + m).reshape(rows, cols)
    from gguf.quants import dequantize as gguf_dequantize

    out = gguf_dequantize(data.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(out.reshape(rows, cols)).to(data.device)


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
    # attributes of a GGUF weight's own (gguf.py sets gguf_groups), which nn.Parameter's types do not name
    param.gguf_groups = new  # type: ignore[attr-defined]
    param.gguf_packed_by = kernels  # type: ignore[attr-defined]
    if len(new) == 1:
        param.data = new[0][1]


def block_matmul(x: torch.Tensor, data: torch.Tensor, ggml_type: int, cols: int, kernels) -> torch.Tensor:
    """x [M, cols] @ W^T for W's blocks, float32 out (the 32-weight types
    packed by set_packed when kernels is not None)."""
    if kernels is not None and x.device.type == "cpu":
        xf = x.float().contiguous()
        if ggml_type in KQUANTS:
            return kernels.gguf_linear_k(xf, data, ggml_type, False)
        return kernels.gguf_linear(xf, data, ggml_type, False)
    return F.linear(x.float(), dequantize(data, ggml_type, cols))
