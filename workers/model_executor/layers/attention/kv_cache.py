"""The KV cache's storage dtype (EngineArgs.kv_cache_dtype, vLLM's
--kv-cache-dtype): `auto` keeps the model's dtype; `fp8` (= `fp8_e4m3`)
stores float8_e4m3fn with a per-tensor scale per layer and per cache
(PagedAttention.k_scale / v_scale: those the checkpoint stores, else 1.0).
A key is stored as k / k_scale, saturated to e4m3's +-448, and read as the
stored value widened and multiplied by k_scale: one byte per element, so
the same budget holds twice the blocks of bfloat16 and four times those of
float32, for a relative rounding error of at most 2 ** -4 (3 mantissa bits)
on values within range.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: e4m3fn has no infinity, so values beyond saturate here


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for the option's value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated (a plain cast turns out-of-range values into NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 values back in `dtype`, widened to float32 and scaled
    first, as the Triton kernel reads them."""
    return (x.float() * scale).to(dtype)


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the cache gives it back: what the attention over fresh keys must see
    so that it matches attention over the cached ones."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)


def layer_scales(layer) -> tuple[float, float]:
    """A layer's (k_scale, v_scale); 1.0 for a stand-in layer without them."""
    return getattr(layer, "k_scale", 1.0), getattr(layer, "v_scale", 1.0)


# Where checkpoints keep per-tensor KV scales (llm-compressor's kv_cache_scheme,
# and the older names vLLM also reads), by name ending -> the scales they set.
_KV_SCALE_NAMES = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the attention module's path, the scales) a checkpoint tensor sets,
    None when it is not a KV scale."""
    for end, which in _KV_SCALE_NAMES.items():
        if name.endswith(end):
            return name[: -len(end)] + ".self_attn.attn", which
    return None


def load_kv_scale(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Sets a layer's stored KV scale from checkpoint tensor `name`; False
    when the tensor is not one. A scale is one positive finite number
    (the same on every tensor-parallel rank); an fp8 cache stores k / k_scale,
    any other cache ignores it."""
    target = kv_scale_target(name)
    if target is None:
        return False
    try:
        attn = model.get_submodule(target[0])
    except AttributeError:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model") from None
    value = tensor.float().flatten()
    if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value[0]) <= 0:
        raise ValueError(
            f"{name}: a KV cache scale must be one positive finite number, got shape {tuple(tensor.shape)}"
        )
    for attr in target[1]:
        setattr(attn, attr, float(value[0]))
    return True
