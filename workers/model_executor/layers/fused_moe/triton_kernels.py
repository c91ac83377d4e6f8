"""The experts of a MoE block as two Triton grouped GEMMs (vLLM's fused_moe design).

moe_align_block_size sorts the (token, k) pairs by expert and pads each
expert's run to a multiple of BLOCK_M, so that every block of BLOCK_M sorted
pairs belongs to one expert. One launch then multiplies every block by its
expert's gate and up rows and applies the activation (SiLU or GELU-tanh
times up); a second multiplies by the expert's down projection and the
routing weight, into one float32 row per pair. A token's k rows are summed
in top-k order, as transformers' grouped_mm experts do.

Every grid size follows from tensor shapes alone (no host sync), so a decode
step can be captured in a CUDA graph. Triton decides at decoration time
whether a kernel is compiled or interpreted: TRITON_INTERPRET=1 must be set
before this module is first imported for it to run on CPU tensors (the
tests do); fused_moe imports it only when the Triton path is taken.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    num_pairs,
    N,
    K,
    padded_len,
    a_row_div,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[pair, n] for each sorted pair of this program's block: a[pair // a_row_div] @ w[e, n]^T.
    GATED: w's rows [0, N) are the gate and [N, 2N) the up projection; out = act(gate) * up.
    Blocks of remote experts (expert id -1) write zeros when MUL_ROUTED_WEIGHT (the last GEMM)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(padded_len, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Consecutive programs share weight columns (GROUP_M blocks of rows per column band): L2 reuse.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    out_mask = row_mask[:, None] & n_mask[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        if MUL_ROUTED_WEIGHT:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // a_row_div)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (
        w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(COMPUTE)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(COMPUTE)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(COMPUTE)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if GATED:
        if ACTIVATION == 0:
            acc = acc * tl.sigmoid(acc)
        else:  # GELU, tanh approximation: tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc * tl.sigmoid(2.0 * z)
        acc = acc * acc_up
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the T*k (token, k) pairs (flat index token * k + slot) by local expert, each expert's
    run padded to a multiple of block_m with the index T*k; pairs of remote experts (expert_map
    -1) go to a last run whose blocks have expert id -1. Returns (sorted_token_ids int32
    [padded_len], expert_ids int32 [padded_len // block_m], num_tokens_post_padded int32 [1]),
    padded_len fixed by the shapes. Experts with no pairs take no blocks."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.to(device)[ids].long()
    ids = torch.where(ids < 0, num_experts, ids)  # the remote run sorts last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_experts, order = torch.sort(ids, stable=True)
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    padded_len = triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((padded_len,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, padded_len, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _block_m(num_pairs: int, num_experts: int) -> int:
    # Few pairs an expert (decode): small blocks waste less padding; tl.dot needs 16 rows at least.
    return 16 if num_pairs <= 2 * num_experts * 16 else 64


def triton_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """fused_experts on the Triton kernels: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I].
    block_m: rows a program (a power of two >= 16); by default from the number of pairs."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported MoE activation {activation!r}")
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    block_m = block_m or _block_m(num_pairs, num_experts)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, block_m, num_experts, expert_map)
    padded_len = sorted_ids.numel()
    # Weights stored narrower than the activations (--weight-dtype bfloat16) widen to them. The
    # interpreter multiplies bfloat16 as raw integers: float32 holds bfloat16 exactly, so it computes there.
    interpreted = isinstance(_moe_gemm_kernel, InterpretedFunction)
    compute = tl.float32 if interpreted and hidden.dtype == torch.bfloat16 else _TL_DTYPES[hidden.dtype]
    precision = "ieee" if compute == tl.float32 else "tf32"  # float32 without TF32, as torch's matmul
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    down = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1).contiguous()
    common = dict(COMPUTE=compute, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4)

    def grid(n):
        return (triton.cdiv(padded_len, block_m) * triton.cdiv(n, 64),)

    _moe_gemm_kernel[grid(inter)](
        hidden, w13, act, weights, sorted_ids, expert_ids, num_post_pad,
        num_pairs, inter, hidden_size, padded_len, top_k,
        hidden.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        GATED=True, ACTIVATION=_ACTIVATIONS[activation], MUL_ROUTED_WEIGHT=False, **common,
    )  # fmt: skip
    _moe_gemm_kernel[grid(hidden_size)](
        act, w2, down, weights, sorted_ids, expert_ids, num_post_pad,
        num_pairs, hidden_size, inter, padded_len, 1,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), down.stride(0),
        GATED=False, ACTIVATION=0, MUL_ROUTED_WEIGHT=True, **common,
    )  # fmt: skip
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
