"""Checkpoints llm-compressor writes (quant_method "compressed-tensors"),
loaded as they are stored (vLLM's CompressedTensorsConfig).

config.json's quantization_config names groups of layers (`targets`: a
class name such as "Linear", a layer name or "re:<regex>") and, for each,
how its weights and input activations are quantized; `ignore` lists layers
kept in float. shoal serves three schemes:
- W8A8 int8: int8 weights with per-channel or per-tensor scales; the
  activations quantized per token at run time (the CPU's integer kernels,
  Triton on a GPU);
- W8A8 fp8: float8_e4m3 weights, per-channel or per-tensor scales, the
  activations per token (torch._scaled_mm on Hopper);
- W4A16: 4-bit integers packed eight to an int32 ("pack-quantized"),
  symmetric, one scale per group of input features (Triton on a GPU).
A static activation scale in the checkpoint (`input_scale`) is read and
not used: per-token scales taken at run time are at least as close.
Anything else is refused at start, naming what is not served.

The checkpoint holds each matrix's parts (q_proj, k_proj, v_proj) where
shoal fuses them (qkv_proj): each part's rows, scales included, go to its
rows of the fused layer; a per-tensor scale becomes its part's rows' scale.
Tensor parallelism cuts packed words and scale groups whole or refuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.workers.model_executor.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
)
from shoal.workers.model_executor.layers.quantization.fp8 import Fp8LinearMethod
from shoal.workers.model_executor.layers.quantization.int8 import Int8LinearMethod

_FORMATS = ("int-quantized", "float-quantized", "pack-quantized", "naive-quantized")
# a fused layer's name -> the checkpoint's names of its parts
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Scheme:
    """How one group's layers are stored: "w8a8_int8", "w8a8_fp8" or "w4a16"."""

    kind: str
    strategy: str  # of the weight scales: "channel", "tensor" or "group"
    group_size: int | None = None
    static_input: bool = False  # the checkpoint carries input_scale


def parse_scheme(name: str, group: dict, fmt: str) -> Scheme:
    """The scheme of one config group, or a ValueError naming what shoal does not serve."""
    w, a = group.get("weights"), group.get("input_activations")
    fmt = group.get("format") or fmt
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors group {name}: quantized output activations are not served")
    if not isinstance(w, dict):
        raise ValueError(f"compressed-tensors group {name}: no weight quantization (activation-only is not served)")
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors group {name}: format {fmt!r} is not served; shoal reads {_FORMATS}")
    bits, wtype, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    symmetric, group_size = w.get("symmetric", True), w.get("group_size")
    what = f"{wtype}{bits} weights ({strategy}, {'symmetric' if symmetric else 'asymmetric'})"
    if a is not None:
        what += f" with {a.get('type', 'int')}{a.get('num_bits')} activations ({a.get('strategy')})"
    if not symmetric:
        raise ValueError(f"compressed-tensors group {name}: {what}: asymmetric weights are not served")
    if w.get("actorder") not in (None, False, "static"):
        raise ValueError(f"compressed-tensors group {name}: {what}: actorder {w['actorder']!r} is not served")
    if a is not None:
        if a.get("num_bits") != 8 or a.get("type", "int") != wtype or not a.get("symmetric", True):
            raise ValueError(f"compressed-tensors group {name}: {what} is not a scheme shoal serves")
        if a.get("strategy") not in ("token", "tensor"):
            raise ValueError(f"compressed-tensors group {name}: {what}: activation strategy is not served")
        static = not a.get("dynamic", False)
        if bits == 8 and strategy in ("channel", "tensor"):
            return Scheme("w8a8_int8" if wtype == "int" else "w8a8_fp8", strategy, None, static)
    elif bits == 4 and wtype == "int" and strategy == "group" and fmt == "pack-quantized":
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise ValueError(f"compressed-tensors group {name}: group_size {group_size!r} is not a multiple of 8")
        return Scheme("w4a16", "group", group_size)
    raise ValueError(
        f"compressed-tensors group {name}: {what} is not served; shoal serves W8A8 int8 or fp8 "
        "(channel or tensor weight scales, token or tensor activations) and W4A16 (pack-quantized, "
        "symmetric, group)"
    )


def _matches(target: str, name: str, layer: nn.Module) -> bool:
    """vLLM's reading of a target: a regex matched from the name's start, a
    layer name, or a class name ("Linear" is every linear layer)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear" or name.endswith("." + target) or target == type(layer).__name__


def check_kv_cache_scheme(scheme) -> None:
    """A kv_cache_scheme is served as vLLM serves it: 8-bit float with one
    static, symmetric scale per tensor (the checkpoint's k_scale / v_scale,
    used by --kv-cache-dtype fp8); any other is refused at start."""
    if not scheme:
        return
    if not isinstance(scheme, dict):
        raise ValueError("compressed-tensors kv_cache_scheme must be an object")
    wanted = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    for key, value in wanted.items():
        # compressed-tensors' defaults are these but for type (int): it must be said
        if scheme.get(key, None if key == "type" else value) != value:
            raise ValueError(
                f"compressed-tensors kv_cache_scheme {key}={scheme.get(key)!r} is not served: "
                "only 8-bit float with a static, symmetric scale per tensor"
            )


class CompressedTensorsConfig(QuantizationConfig):
    def __init__(self, groups: list[tuple[list[str], Scheme]], ignore: list[str]):
        self.groups, self.ignore = groups, ignore

    def get_name(self) -> str:
        return "compressed-tensors"

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsConfig:
        """From the model's config.json (its quantization_config) or that dict itself."""
        qc = config.get("quantization_config", config)
        if qc.get("quant_method") != "compressed-tensors":
            raise ValueError(f"quant_method {qc.get('quant_method')!r} is not compressed-tensors")
        check_kv_cache_scheme(qc.get("kv_cache_scheme"))
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise ValueError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not served")
        groups_cfg = qc.get("config_groups")
        if not isinstance(groups_cfg, dict) or not groups_cfg:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        fmt = qc.get("format", "dense")
        groups = []
        for name, g in groups_cfg.items():
            targets = g.get("targets") if isinstance(g, dict) else None
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"compressed-tensors group {name}: targets must be a list of names")
            groups.append((targets, parse_scheme(name, g, fmt)))
        return cls(groups, list(qc.get("ignore") or []))

    def linear_weight_bytes(self, dtype: torch.dtype) -> float:
        """The widest of the groups' stored weights: one byte (W8A8: a scale
        per row besides, not counted), or half a byte and a scale (in the
        model's dtype while loading) per group."""
        return max(1.0 if s.kind != "w4a16" else 0.5 + dtype.itemsize / cast(int, s.group_size) for _, s in self.groups)

    def scheme_for(self, layer: nn.Module, prefix: str) -> Scheme | None:
        """The scheme of the layer the checkpoint calls `prefix` (every part of a
        fused layer must agree), None where it is ignored or no group targets it."""
        head, _, last = prefix.rpartition(".")
        names = [f"{head}.{p}" for p in _FUSED[last]] if last in _FUSED else [prefix]
        found: set[Scheme | None] = set()
        for name in names:
            if any(_matches(t, name, layer) and t != "Linear" for t in self.ignore):
                found.add(None)
                continue
            found.add(next((s for targets, s in self.groups if any(_matches(t, name, layer) for t in targets)), None))
        if len(found) > 1:
            raise ValueError(f"{prefix}: the parts {names} are stored in different schemes; shoal fuses them")
        return found.pop()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from shoal.workers.model_executor.layers.fused_moe.layer import FusedMoE
        from shoal.workers.model_executor.layers.linear import LinearBase

        if not isinstance(layer, (LinearBase, FusedMoE)):
            return None  # the embedding and the LM head: float, as llm-compressor leaves them
        scheme = self.scheme_for(layer, prefix)
        if scheme is None:
            return None
        # (a FusedMoE refuses any method, naming itself: quantized experts are not served yet)
        methods: dict[str, Callable[[Scheme], QuantizeMethodBase]] = {
            "w8a8_int8": CTInt8Method,
            "w8a8_fp8": CTFp8Method,
            "w4a16": CTW4A16Method,
        }
        return methods[scheme.kind](scheme)


# --- loading: each stored tensor into this rank's part of its parameter ---


def _rows_of(layer: Any, shard_id: int | None) -> tuple[int, int, int, int]:
    """(full rows of this part, rows here, first row taken, offset in the parameter)."""
    shards = getattr(layer, "shards", None)
    if shards is None:  # a row-parallel layer: every output row, one part
        return layer.output_size, layer.output_size, 0, 0
    shard_id = shard_id or 0
    full, local, start = shards[shard_id]
    return full, local, start, sum(n for _, n, _ in shards[:shard_id])


def _cols_of(layer: Any, per: int, what: str) -> tuple[int, int]:
    """(first, count) of this rank's stored columns, `per` input features to
    a column (8 to a packed word, group_size to a scale)."""
    tp = getattr(layer, "tp", None)
    if tp is None or tp.size == 1 or not hasattr(layer, "input_start"):
        return 0, -1
    local = layer.input_full // tp.size
    if local % per:
        raise ValueError(
            f"tensor parallelism would cut {what} of {per} input features (each rank's {local} of "
            f"{layer.input_full}): choose a tensor-parallel size that keeps them whole"
        )
    return layer.input_start // per, local // per


def make_loader(layer: nn.Module, by_rows: bool, per_col: int | None, what: str):
    """A weight_loader for a stored tensor: rows follow the output features
    when `by_rows` (else one value for the whole part: a per-tensor scale,
    spread over the part's rows); columns follow the input features, `per_col`
    of them to a column (None: columns are not cut)."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        full, local, start, offset = _rows_of(layer, shard_id)
        if not by_rows:
            if tensor.numel() != 1:
                raise ValueError(f"{what}: a per-tensor value has shape {tuple(tensor.shape)}")
            param.data.narrow(0, offset, local).fill_(tensor.reshape(()).float().item())
            return
        if tensor.dim() == 1:
            tensor = tensor.unsqueeze(1)
        if tensor.shape[0] != full:
            raise ValueError(f"{what}: checkpoint has {tensor.shape[0]} rows, the layer {full}")
        part = tensor.narrow(0, start, local)
        if per_col is not None:
            first, count = _cols_of(layer, per_col, what)
            if count >= 0:
                part = part.narrow(1, first, count)
        dest = param.data.narrow(0, offset, local)
        if tuple(part.shape) != tuple(dest.shape):
            raise ValueError(f"{what}: checkpoint part {tuple(part.shape)} != expected {tuple(dest.shape)}")
        dest.copy_(part)

    return load


def _param(layer: nn.Module, name: str, shape: tuple, dtype: torch.dtype, loader) -> None:
    p: Any = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)  # with a weight_loader
    p.weight_loader = loader
    layer.register_parameter(name, p)


def _ignore(param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
    """Read and not used (a static input scale; weight_shape, known from the layer)."""


class _CTMethod:
    """What the three schemes share: the checkpoint's scales (per channel or
    per tensor) loaded into float32 per-row scales, and input_scale accepted."""

    def __init__(self, scheme: Scheme):
        self.scheme = scheme

    def _scales_and_extras(self, layer: nn.Module, rows: int) -> None:
        per_tensor = self.scheme.strategy == "tensor"
        _param(
            layer, "weight_scale", (rows, 1), torch.float32, make_loader(layer, not per_tensor, None, "weight_scale")
        )
        if self.scheme.static_input:
            _param(layer, "input_scale", (1,), torch.float32, _ignore)


class _W8A8Stored(_CTMethod):
    """W8A8: the stored 8-bit rows and their scales."""

    stored_dtype: torch.dtype

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *args, **extra) -> None:
        rows = sum(output_partition_sizes)
        shape = (rows, input_size_per_partition)
        _param(layer, "weight", shape, self.stored_dtype, make_loader(layer, True, 1, f"{self.stored_dtype} weight"))
        self._scales_and_extras(layer, rows)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = cast(torch.Tensor, layer.weight_scale)
        layer.weight_scale = nn.Parameter(scale.data.float().reshape(-1), requires_grad=False)


class CTInt8Method(_W8A8Stored, Int8LinearMethod):
    """W8A8 int8, multiplied as --quantization int8."""

    stored_dtype = torch.int8


class CTFp8Method(_W8A8Stored, Fp8LinearMethod):
    """W8A8 fp8 (float8_e4m3), multiplied as --quantization fp8."""

    stored_dtype = torch.float8_e4m3fn


class CTW4A16Method(_CTMethod, LinearMethodBase):
    """W4A16: 4-bit weights packed eight to an int32 along the input
    features, one scale per group; the activations stay in the model's dtype."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *args, **extra) -> None:
        k, g = input_size_per_partition, self.scheme.group_size
        if k % g:
            raise ValueError(f"W4A16 groups of {g} do not divide this layer's {k} input features")
        rows = sum(output_partition_sizes)
        _param(layer, "weight_packed", (rows, k // 8), torch.int32, make_loader(layer, True, 8, "weight_packed"))
        _param(layer, "weight_scale", (rows, k // g), torch.float32, make_loader(layer, True, g, "weight_scale"))
        _param(layer, "weight_shape", (2,), torch.int64, _ignore)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from shoal.workers.model_executor.layers.quantization.triton_quant import dequantize_int4, w4a16_mm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        g = cast(int, self.scheme.group_size)  # set for W4A16 (parse_scheme)
        packed, scale = cast(torch.Tensor, layer.weight_packed), cast(torch.Tensor, layer.weight_scale)
        if x.is_cuda:
            y = w4a16_mm(x2, packed, scale, g, bias)
        else:  # the reference: the weights expanded per call (Triton's path is the GPU's)
            w = dequantize_int4(packed, scale, shape[-1], g)
            y = F.linear(x2.float(), w, None if bias is None else bias.float()).to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])
