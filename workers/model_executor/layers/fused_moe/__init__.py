"""Mixture-of-experts kernels: top-k routing and the fused experts (CPU and Triton)."""

from shoal.workers.model_executor.layers.fused_moe.fused_moe import fused_experts
from shoal.workers.model_executor.layers.fused_moe.router import select_experts

__all__ = ["fused_experts", "select_experts"]
