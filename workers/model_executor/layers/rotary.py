"""Rotary position embeddings with the scaling variants found in Llama 3,
Qwen2 and long-context configs: default, linear, llama3 and yarn."""

from __future__ import annotations

import math

import torch

from shoal.workers.model_executor.layers.custom_op import CustomOp


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor (yarn's mscale)."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, factor, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn(dim: int, theta: float, factor: float, s: dict) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    orig = s["original_max_position_embeddings"]

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(CustomOp):
    """Holds cos/sin for every position up to max_positions (computed in
    float32 as transformers does, then cast once)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, fused_ops: bool = False):
        super().__init__(fused_ops)
        inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos() * attn_scale, persistent=False)
        self.register_buffer("sin_cached", emb.sin() * attn_scale, persistent=False)

    # q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. On CUDA (or with
    # EngineArgs.fused_ops, see fused_ops) one Triton kernel for both; on the
    # CPU with the compiled kernels, one C++ call that rotates them in place
    # (they are views of this layer's own q/k/v output).
    def forward_fused(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        from shoal.workers.model_executor.layers import fused_ops

        return fused_ops.rotary_embedding(positions, q, k, self.cos_cached, self.sin_cached)

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cpu_kernels is not None and q.dtype == torch.float32 == self.cos_cached.dtype:
            self.cpu_kernels.rotary_embedding(positions, q, k, self.cos_cached, self.sin_cached)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos_cached[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cached[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
