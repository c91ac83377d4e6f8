"""Rotary position embeddings with the scaling variants found in Llama 3,
Qwen2, Phi-3 and long-context configs: default, linear, llama3, yarn and
longrope; optionally over only the first `rotary_dim` dims of each head
(partial rotary: Phi-4-mini, say), the rest passing through unchanged."""

from __future__ import annotations

import math

import torch

from shoal.workers.model_executor.layers.custom_op import CustomOp


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_positions: int | None = None):
    """Inverse frequencies of `dim` rotated dims and the attention scaling
    factor that multiplies cos and sin (yarn's mscale, longrope's factor).
    max_positions: the longest sequence served (longrope picks its factors by it)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "longrope":
        return _longrope(dim, theta, scaling, max_positions)
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
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn, longrope)")


def _longrope(dim: int, theta: float, s: dict, max_positions: int | None) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: one rescale factor per frequency, a short set for
    contexts within original_max_position_embeddings and a long set beyond.

    transformers picks the set by the current sequence length and, when a
    sequence outgrows the original context, recomputes its whole cache with
    the long set. Keys in a paged cache (shared by prefix caching) cannot be
    recomputed, so the set is fixed per engine, as vLLM and llama.cpp fix it:
    long when the engine serves sequences longer than the original context
    (max_positions > original), else short. Equal to transformers for every
    sequence when max_model_len <= original, and for prompts longer than the
    original context otherwise; a shorter sequence on such an engine gets the
    long set where transformers would use the short one.
    `factor` (default: max_position_embeddings / original, which the model
    fills in) sets the attention factor unless `attention_factor` is given."""
    orig = s["original_max_position_embeddings"]
    factor = float(s["factor"])
    attn = s.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    long = max_positions is not None and max_positions > orig
    ext = s["long_factor" if long else "short_factor"]
    ext = torch.ones(dim // 2) if ext is None else torch.as_tensor(ext, dtype=torch.float32).reshape(-1)
    if ext.numel() != dim // 2:
        raise ValueError(f"longrope needs {dim // 2} rescale factors (half the rotated dims), got {ext.numel()}")
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), float(attn)


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
    float32 as transformers does, then cast once), over the first
    `rotary_dim` dims of each head (default: all of them)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        fused_ops: bool = False,
        rotary_dim: int | None = None,
    ):
        super().__init__(fused_ops)
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {head_dim}")
        cos, sin = self._tables(scaling)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def _tables(self, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attn_scale = rope_inv_freq(self.rotary_dim, self.theta, scaling, self.max_positions)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attn_scale, emb.sin() * attn_scale

    def set_scaling(self, scaling: dict | None) -> None:
        """Recomputes the tables in place (their dtype and device kept): for
        scaling known only once the weights are read (a GGUF file's longrope
        factors are tensors)."""
        cos, sin = self._tables(scaling)
        self.cos_cached.copy_(cos)
        self.sin_cached.copy_(sin)

    # q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. On CUDA (or with
    # EngineArgs.fused_ops, see fused_ops) one Triton kernel for both; on the
    # CPU with the compiled kernels, one C++ call that rotates them in place
    # (they are views of this layer's own q/k/v output). Both take the first
    # rotary_dim dims of each head as a strided view, so partial rotary runs
    # on them too.
    def forward_fused(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        from shoal.workers.model_executor.layers import fused_ops

        r = self.rotary_dim
        if r == self.head_dim:
            return fused_ops.rotary_embedding(positions, q, k, self.cos_cached, self.sin_cached)
        q_rot, k_rot = fused_ops.rotary_embedding(positions, q[..., :r], k[..., :r], self.cos_cached, self.sin_cached)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cpu_kernels is not None and q.dtype == torch.float32 == self.cos_cached.dtype:
            r = self.rotary_dim
            self.cpu_kernels.rotary_embedding(positions, q[..., :r], k[..., :r], self.cos_cached, self.sin_cached)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos_cached[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cached[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r == self.head_dim:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, k_rot = q[..., :r], k[..., :r]
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
