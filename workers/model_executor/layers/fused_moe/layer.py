"""A mixture-of-experts layer (vLLM's FusedMoE): every expert's SwiGLU MLP
in two stacked parameters, the top-k routing and the fused experts call.

Split across the tensor-parallel group one of two ways:

- tensor parallel (the default): every rank holds every expert, each
  expert's intermediate width cut in K (w13's gate rows and up rows, w2's
  columns), as ColumnParallelLinear.even and RowParallelLinear cut a dense MLP;
- expert parallel (EngineArgs.enable_expert_parallel, TPGroup.expert_parallel):
  rank r holds experts [r*E/K, (r+1)*E/K) whole, and `expert_map` sends the
  other ranks' experts to -1.

Either way each rank's output is a partial sum over its part of the
experts' work, and one all-reduce over the group completes it.

Each forward also counts the (token, expert) picks per expert, so a
benchmark can read the load balance (`expert_load`).
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.model_executor.layers.fused_moe.fused_moe import fused_experts
from shoal.workers.model_executor.layers.fused_moe.router import select_experts
from shoal.workers.model_executor.layers.parallel_state import get_tp_group
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.weight_utils import check_shape

# The checkpoint's three matrices of one expert: gate (w1), up (w3), down (w2).
W1, W3, W2 = "w1", "w3", "w2"


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        activation: str = "silu",
        cast_topk_weights: bool = False,
    ):
        """cast_topk_weights: round the router's weights to the model dtype
        before weighting the experts (Qwen3-MoE's numerics; Mixtral's stay float32)."""
        super().__init__()
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        if method is not None:
            raise NotImplementedError(f"{prefix}: quantized mixture-of-experts weights are not supported yet")
        self.quant_method = None
        self.cpu_kernels = None  # the compiled CPU kernels, when the model runner binds them
        self.tp = tp = get_tp_group()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size = intermediate_size  # one expert's full width
        self.renormalize, self.activation, self.cast_topk_weights = renormalize, activation, cast_topk_weights
        self.use_ep = tp.expert_parallel and tp.size > 1
        if self.use_ep:
            if num_experts % tp.size:
                raise ValueError(f"expert-parallel size {tp.size} does not divide the model's {num_experts} experts")
            self.ep_size, self.ep_rank = tp.size, tp.rank
            self.local_num_experts = num_experts // tp.size
            self.expert_start = tp.rank * self.local_num_experts
            self.i_local, self.i_start = intermediate_size, 0
            expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
            expert_map[self.expert_start : self.expert_start + self.local_num_experts] = torch.arange(
                self.local_num_experts
            )
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"tensor_parallel_size {tp.size} does not divide the expert width {intermediate_size}")
            self.ep_size, self.ep_rank = 1, 0
            self.local_num_experts, self.expert_start = num_experts, 0
            self.i_local = intermediate_size // tp.size
            self.i_start = tp.rank * self.i_local
            self.expert_map = None
        e, i = self.local_num_experts, self.i_local
        dtype = torch.get_default_dtype()
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader
        # Picks per global expert since the last reset (every rank routes every token alike).
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: tuple[int, str] | None) -> None:
        """One checkpoint matrix, shard_id = (global expert id, "w1" | "w3" | "w2"),
        this rank's part of it copied in (nothing for another rank's expert);
        or, shard_id None, every expert stacked as transformers holds them in
        memory: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]."""
        if shard_id is None:
            if param is self.w13_weight:
                want = (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
                check_shape("stacked gate/up", tensor.shape, want)
                for e, (w1, w3) in enumerate(t.chunk(2, dim=0) for t in tensor.unbind(0)):
                    self.weight_loader(param, w1, (e, W1))
                    self.weight_loader(param, w3, (e, W3))
            else:
                check_shape("stacked down", tensor.shape[:1], (self.num_experts,))
                for e, w2 in enumerate(tensor.unbind(0)):
                    self.weight_loader(param, w2, (e, W2))
            return
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is beyond the model's {self.num_experts}")
        local = expert - self.expert_start
        if not 0 <= local < self.local_num_experts:
            return  # another rank's expert
        full, part, start = self.intermediate_size, self.i_local, self.i_start
        if which in (W1, W3):
            check_shape(f"expert {expert} {which}", tensor.shape, (full, self.hidden_size))
            offset = 0 if which == W1 else part
            param.data[local].narrow(0, offset, part).copy_(tensor.narrow(0, start, part))
        elif which == W2:
            check_shape(f"expert {expert} w2", tensor.shape, (self.hidden_size, full))
            param.data[local].copy_(tensor.narrow(1, start, part))
        else:
            raise ValueError(f"unknown expert matrix {which!r}")

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> the experts' weighted sum [T, H], reduced over the group."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.cast_topk_weights:
            topk_weights = topk_weights.to(hidden.dtype)
        # index_add_, not bincount: no host sync, so it also runs inside a CUDA graph.
        ids = topk_ids.reshape(-1)
        self.expert_tokens.index_add_(0, ids, torch.ones_like(ids, dtype=self.expert_tokens.dtype))
        out = fused_experts(
            hidden,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.activation,
            self.expert_map,
            self.cpu_kernels,
        )
        # Expert parallelism is the all-to-all scheme (dispatch each token to
        # its experts' ranks, combine their outputs back) degenerate for
        # activations every rank already holds in full after attention's
        # all-reduce: dispatch is each rank picking, for every token, the picks
        # of its own experts, and combine is this one all-reduce of the partial
        # sums (an all-gather and a reduce-scatter, fused). Under tensor
        # parallelism it is the row-parallel down projection's own reduction.
        return self.tp.all_reduce(out)

    def expert_load(self) -> torch.Tensor:
        """(token, expert) picks per global expert since the last reset, int64 [E] on the CPU."""
        return self.expert_tokens.cpu()

    def rank_load(self) -> torch.Tensor:
        """Picks per expert-parallel rank (its contiguous experts summed); one entry without EP."""
        return self.expert_load().view(self.ep_size, -1).sum(dim=1)

    def reset_expert_load(self) -> None:
        self.expert_tokens.zero_()
