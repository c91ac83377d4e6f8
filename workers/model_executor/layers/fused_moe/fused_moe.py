"""The experts of a MoE block in one call: each token's k chosen experts'
SwiGLU MLPs, weighted by the router and summed (vLLM's fused_experts).

w13 [E, 2*I, H] holds each expert's gate rows then its up rows, w2 [E, H, I]
its down projection. On the CPU the (token, k) pairs are sorted by expert
once and their rows gathered once; each expert that received rows then
multiplies its slice of them, every expert in one call of the compiled
few-row kernel per projection (csrc/cpu_gemm.cpp), or expert by expert
through platforms/cpu/matmul.py (the BLAS for long prompt chunks, or without the
kernels). On CUDA a Triton grouped GEMM (triton_kernels.py) does every
expert in one launch per projection.

Numerics are those of transformers' default experts implementation
(grouped_mm, which its MoE models pick on every device): each expert output
in hidden's dtype, times its routing weight in their promoted dtype, then a
token's k products summed in top-k order by one reduction. In float32 the
CPU path without the compiled kernel matches it bit for bit. (transformers'
eager loop instead index_adds the experts in id order.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.workers.model_executor.platforms.cpu.matmul import MAX_KERNEL_ROWS, linear


def _act_and_mul(x: torch.Tensor, activation: str, cpu_kernels) -> torch.Tensor:
    if activation == "silu" and cpu_kernels is not None and x.dtype == torch.float32:
        return cpu_kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unsupported MoE activation {activation!r}")


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    cpu_kernels=None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype.

    topk_weights [T, k]: float32 as select_experts gives them (Mixtral), or
    rounded to hidden's dtype first (Qwen3-MoE does). topk_ids [T, k] global
    expert ids. expert_map (expert parallelism): global expert id -> local index into
    w13/w2, -1 for experts another rank holds; those picks add nothing."""
    if use_triton is None:
        use_triton = hidden.is_cuda
    if use_triton:
        from shoal.workers.model_executor.layers.fused_moe.triton_kernels import triton_fused_experts

        return triton_fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map)
    return _cpu_fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, cpu_kernels)


def _grouped_kernel(cpu_kernels, xs, w13, w2, most_rows: int):
    """The compiled kernel's every-expert-at-once matmul where it applies: float32 rows, at most
    MAX_KERNEL_ROWS an expert (longer prompt chunks go to the BLAS expert by expert)."""
    grouped = getattr(cpu_kernels, "grouped_small_m_linear", None)
    if (
        grouped is None
        or xs.dtype != torch.float32
        or not 0 < most_rows <= MAX_KERNEL_ROWS
        or w13.shape[2] % 16
        or w2.shape[2] % 16
        or not (w13.is_contiguous() and w2.is_contiguous())
    ):
        return None
    return grouped


def _cpu_fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, expert_map, cpu_kernels):
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map[ids].long()
    # One sort of the T*k (token, slot) pairs by expert; pairs of remote experts (-1) sort first
    # and are left out. The rows and weights are gathered once in that order, so each expert
    # takes a contiguous slice of them.
    sorted_ids, order = torch.sort(ids, stable=True)
    count_tensor = torch.bincount(sorted_ids + 1, minlength=w13.shape[0] + 1)
    counts = count_tensor.tolist()
    pairs = order[counts[0] :]
    xs = hidden[pairs // top_k]
    weights = topk_weights.reshape(-1)[pairs, None]
    # As transformers: the expert output (hidden's dtype) times the weight in their promoted dtype
    # (float32 for Mixtral's weights; Qwen3-MoE's are rounded to the model dtype first).
    out_dtype = torch.promote_types(hidden.dtype, weights.dtype)
    grouped = _grouped_kernel(cpu_kernels, xs, w13, w2, max(counts[1:]))
    if grouped is not None:
        offsets = F.pad(count_tensor[1:].cumsum(0), (1, 0))
        h = _act_and_mul(grouped(xs, w13, offsets), activation, cpu_kernels)
        ys = grouped(h, w2, offsets).mul_(weights)
    else:
        ys = torch.empty(len(pairs), hidden.shape[1], dtype=out_dtype, device=hidden.device)
        start = 0
        for e, n in enumerate(counts[1:]):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = _act_and_mul(linear(xs[rows], w13[e], None, cpu_kernels), activation, cpu_kernels)
            torch.mul(linear(h, w2[e], None, cpu_kernels), weights[rows], out=ys[rows])
            start += n
    if cpu_kernels is not None:
        # The kernel's dot products already round differently from transformers' in the last bits:
        # sum each token's rows with one index_add_ (two ops where the exact order below takes four,
        # a decode step's MoE layer pays each op's dispatch).
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=out_dtype, device=hidden.device)
        return out.index_add_(0, pairs // top_k, ys).to(hidden.dtype)
    out = torch.zeros(num_tokens * top_k, hidden.shape[1], dtype=out_dtype, device=hidden.device)
    out[pairs] = ys
    return out.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1).to(hidden.dtype)
