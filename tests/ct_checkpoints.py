"""Compressed-tensors checkpoints written the way llm-compressor saves them
(config.json's quantization_config, and per linear layer `weight` in int8
or float8_e4m3fn with `weight_scale`, or `weight_packed` / `weight_scale` /
`weight_shape` for pack-quantized 4-bit), made from a tiny float model.

Beside each, a float checkpoint of the same weights expanded (w = q * scale):
what the quantized model must compute, up to its activation quantization.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# llm-compressor's presets (compressed_tensors.quantization.quant_scheme), as config groups
SCHEMES = {
    "int8_channel": dict(
        weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        input_activations=dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
        format="int-quantized",
    ),
    "fp8_channel": dict(  # FP8_DYNAMIC
        weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
        input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True),
        format="float-quantized",
    ),
    "fp8_tensor": dict(  # FP8: static activation scales in the checkpoint
        weights=dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False),
        input_activations=dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False),
        format="float-quantized",
    ),
    "w4a16": dict(
        weights=dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True, dynamic=False),
        format="pack-quantized",
    ),
}


def quantize(w: torch.Tensor, scheme: str, group_size: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the stored tensors of one weight, the weight they expand to)."""
    w = w.float()
    if scheme == "int8_channel":
        s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        q = torch.round(w / s).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": s}, q.float() * s
    if scheme in ("fp8_channel", "fp8_tensor"):
        amax = w.abs().amax(dim=1, keepdim=True) if scheme == "fp8_channel" else w.abs().amax().reshape(1)
        s = amax.clamp(min=1e-8) / 448
        q = (w / (s if scheme == "fp8_channel" else s[0])).to(torch.float8_e4m3fn)
        out = {"weight": q, "weight_scale": s}
        if scheme == "fp8_tensor":
            out["input_scale"] = torch.tensor([0.05])
        return out, q.float() * (s if scheme == "fp8_channel" else s[0])
    from shoal.workers.model_executor.layers.quantization.triton_quant import pack_int4  # imports Triton: late

    g = group_size
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    s = groups.abs().amax(dim=2).clamp(min=1e-8) / 7.5
    q = torch.round(groups / s[..., None]).clamp(-8, 7).to(torch.int8).reshape(n, k)
    stored = {"weight_packed": pack_int4(q), "weight_scale": s.to(torch.bfloat16), "weight_shape": torch.tensor([n, k])}
    return stored, q.float() * s.to(torch.bfloat16).float().repeat_interleave(g, dim=1)


def write_checkpoints(src: str, quantized: str, expanded: str, scheme: str, group_size: int = 128) -> None:
    """From the float model in `src`: the compressed-tensors checkpoint in
    `quantized` and its weights expanded to float in `expanded` (W4A16 in
    groups of `group_size`)."""
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    stored, plain = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in _LINEARS:
            parts, w = quantize(t, scheme, group_size)
            stored.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
            plain[name] = w.contiguous()
        else:
            stored[name] = plain[name] = t
    for out, weights, quant in ((quantized, stored, True), (expanded, plain, False)):
        shutil.copytree(src, out, dirs_exist_ok=True)
        save_file(weights, os.path.join(out, "model.safetensors"))
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        if quant:
            group = json.loads(json.dumps({"targets": ["Linear"], **SCHEMES[scheme]}))
            if scheme == "w4a16":
                group["weights"]["group_size"] = group_size
            fmt = group["format"]
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors",
                "format": fmt,
                "config_groups": {"group_0": group},
                "ignore": ["lm_head"],
                "quantization_status": "compressed",
            }
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)
