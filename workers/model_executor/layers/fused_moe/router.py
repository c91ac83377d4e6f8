"""Top-k routing of a MoE block: which experts each token goes to, and with
what weight. The numerics are transformers' Qwen3-MoE / Mixtral routers'."""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, k], topk_ids int64 [T, k]).

    Softmax in float32 over all experts, then the top k (descending, ties to
    the lower id as torch.topk breaks them); with `renormalize` the k weights
    are divided by their sum (Qwen3-MoE's norm_topk_prob, always on in
    Mixtral). The weights stay float32: Mixtral multiplies the expert outputs
    by them in float32, while Qwen3-MoE first rounds them to the model dtype
    (`topk_weights.to(hidden.dtype)` at the caller; a no-op in float32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
