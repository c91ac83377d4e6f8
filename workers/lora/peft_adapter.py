"""A LoRA adapter as peft saves it (adapter_config.json beside
adapter_model.safetensors), read and checked against the base model before
it is registered.

peft's update of a linear layer is y += scaling * x A^T B^T, A [r, in] and
B [out, r] per target module, with scaling = lora_alpha / r, or
lora_alpha / sqrt(r) under use_rslora. Served: the seven projections of a
decoder layer (q, k, v, o, gate, up, down), one rank and alpha for all of
them. Refused with the reason, before anything is kept: a rank above
max_lora_rank, another base model's name or shapes, a layer or module the
model lacks (embeddings, the LM head and a mixture of experts' MLP
included), DoRA, trained biases,
modules_to_save, and per-module rank or alpha patterns. Each file is read
once (files.py) and the tensors checked are the ones kept: the adapter's
`digest` fingerprints those bytes, so that a reread can tell a change.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field

import torch

from shoal.proto.errors import InvalidRequestError, LoRAAdapterError
from shoal.proto.lora.files import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterFilesError,
    AdapterPathForbidden,
    digest,
    public_message,
    read_file,
    under_root,
)
from shoal.proto.lora.request import LoRARequest
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.moe import is_moe_layer

logger = logging.getLogger(__name__)
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (peft's names, the adapter name dropped)
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights in float32, by (layer index, module name): (A [r, in], B [out, r])."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    base_model_name: str | None = None
    digest: str = ""  # of the files' bytes as read (files.digest)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model, unsharded."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def peft_scaling(lora_alpha: float, rank: int, use_rslora: bool) -> float:
    """peft's LoraLayer.update_layer: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


def _read_config(request: LoRARequest, root: str | None) -> tuple[bytes, dict]:
    name = request.lora_name
    raw = read_file(name, os.path.join(under_root(request.lora_path, root), CONFIG_FILE), root, MAX_CONFIG_BYTES)
    try:
        cfg = json.loads(raw)
    except ValueError as e:  # (UnicodeDecodeError included)
        raise AdapterFilesError(name, f"{CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterFilesError(name, f"{CONFIG_FILE} is not an object")
    return raw, cfg


def _max_weights_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest file an adapter of rank <= max_rank can be: every module of
    every layer in float64, and room for the header's names."""
    per_layer = sum(i + o for i, o in module_shapes(config).values()) * max_rank * 8
    return config.num_hidden_layers * (per_layer + 14 * 512) + (64 << 10)


def _read_weights(request: LoRARequest, root: str | None, config: ModelConfig, max_rank: int):
    """(the file's bytes, its tensors by name), from one read."""
    from safetensors.torch import load

    name = request.lora_name
    path = os.path.join(under_root(request.lora_path, root), WEIGHTS_FILE)
    raw = read_file(name, path, root, _max_weights_bytes(config, max_rank))
    try:
        return raw, load(raw)
    except Exception as e:  # safetensors' own error for a file that is not one
        raise AdapterFilesError(name, f"{WEIGHTS_FILE} is not a safetensors file: {type(e).__name__}: {e}") from None


def _check_config(name: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a peft LoraConfig shoal serves, else a ValueError saying what it is not."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: rank r must be a positive integer; got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha must be a finite number; got {alpha!r}")
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained layers)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not served")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={cfg.get('bias')!r}) are not served")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r}: fan_in_fan_out (Conv1D layers) is not served")
    return rank, peft_scaling(float(alpha), rank, bool(cfg.get("use_rslora")))


def load_peft_adapter(
    request: LoRARequest,
    config: ModelConfig,
    max_rank: int,
    base_model_name: str | None = None,
    root: str | None = None,
) -> LoRAAdapter:
    """The adapter request.lora_path holds, checked against `config`'s
    shapes, and against base_model_name (the served model's) where the
    request names the base it is for (--lora-modules' base_model_name). The
    adapter's own base_model_name_or_path is kept, not compared: it is often
    a hub id where the served model is a local path. root: files whose real
    path lies outside it are refused (AdapterPathForbidden; a runtime load's
    --lora-root). Files missing or unreadable raise AdapterFilesError; an
    adapter not served, a ValueError naming the reason."""
    name = request.lora_name
    raw_config, cfg = _read_config(request, root)
    rank, scaling = _check_config(name, cfg, max_rank)
    wanted = request.base_model_name
    if wanted and base_model_name and wanted != base_model_name:
        raise ValueError(f"LoRA adapter {name!r} is for base model {wanted!r}, not {base_model_name!r}")
    raw_weights, tensors = _read_weights(request, root, config, max_rank)
    shapes = module_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B of a decoder layer's "
                f"projection (embeddings, the LM head and other modules are not served)"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise ValueError(
                f"LoRA adapter {name!r}: target module {module!r} is not one of {', '.join(LINEAR_MODULES)}"
            )
        if layer >= config.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} is beyond the base model's {config.num_hidden_layers}"
            )
        if module in ("gate_proj", "up_proj", "down_proj") and is_moe_layer(config, layer):
            raise ValueError(
                f"LoRA adapter {name!r}: layers.{layer}.{module}: that layer's MLP is a mixture of experts, "
                "whose experts take no adapter"
            )
        parts.setdefault((layer, module), {})[which] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(
        name,
        request.lora_int_id,
        request.lora_path,
        rank,
        scaling,
        base_model_name=cfg.get("base_model_name_or_path"),
        digest=digest(raw_config, raw_weights),
    )
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ValueError(f"LoRA adapter {name!r}: layers.{layer}.{module} lacks its lora_{missing}")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: layers.{layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"where the base model and rank {rank} need {(rank, fan_in)} and {(fan_out, rank)}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"LoRA adapter {name!r}: layers.{layer}.{module} is not floating point")
        a, b = a.float().contiguous(), b.float().contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {name!r}: layers.{layer}.{module} holds NaN or infinite values")
        adapter.weights[(layer, module)] = (a, b)
    return adapter


def read_lora_adapter(
    request: LoRARequest,
    config: ModelConfig,
    max_rank: int,
    base_model_name: str | None = None,
    root: str | None = None,
) -> LoRAAdapter:
    """load_peft_adapter, for the engine: every refusal an InvalidRequestError
    (400), or a LoRAAdapterError 'forbidden' (403) outside the root. Files
    missing or unreadable (or anything unforeseen) get one message that says
    nothing of the filesystem; their detail goes to the log."""
    name = request.lora_name
    try:
        return load_peft_adapter(request, config, max_rank, base_model_name, root)
    except AdapterPathForbidden as e:
        logger.warning("refused: %s", e)
        raise LoRAAdapterError(e.public, "forbidden", "lora_path") from None
    except AdapterFilesError as e:
        logger.warning("refused: %s", e)
        raise InvalidRequestError(e.public, field="lora_request") from None
    except ValueError as e:  # the adapter read, and not one shoal serves: the reason helps its owner
        raise InvalidRequestError(str(e), field="lora_request") from None
    except Exception:
        logger.exception("LoRA adapter %r: reading %r failed", name, request.lora_path)
        raise InvalidRequestError(public_message(name), field="lora_request") from None
