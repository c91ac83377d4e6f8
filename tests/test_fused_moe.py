"""The MoE kernels (layers/fused_moe/): top-k routing against transformers'
Qwen3-MoE and Mixtral routers, the fused experts against those models'
whole sparse MoE blocks and against a loop over experts written here, on
the CPU path (with and without the compiled matmul) and the Triton grouped
GEMM run by Triton's interpreter."""

from __future__ import annotations

import math
import os

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before the kernel module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from shoal.workers.model_executor.layers.fused_moe import fused_experts, select_experts
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

H, INTER, E = 64, 48, 8  # hidden, expert intermediate, experts


def reference(hidden, w13, w2, topk_weights, topk_ids, activation="silu", expert_map=None):
    """A loop over experts: each expert's (token, slot) pairs in ascending order through its MLP,
    then each token's k weighted outputs summed in slot order (transformers' grouped_mm order)."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1) if expert_map is None else expert_map[topk_ids.reshape(-1)]
    weights = topk_weights.reshape(-1)
    out = torch.zeros(num_tokens * k, hidden.shape[1], dtype=torch.promote_types(hidden.dtype, weights.dtype))
    for e in range(w13.shape[0]):
        pairs = (ids == e).nonzero()[:, 0]
        if len(pairs) == 0:
            continue
        gate, up = F.linear(hidden[pairs // k], w13[e].to(hidden.dtype)).chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        out[pairs] = F.linear(act * up, w2[e].to(hidden.dtype)) * weights[pairs, None]
    return out.view(num_tokens, k, -1).sum(dim=1).to(hidden.dtype)


def make_weights(gen, num_experts=E, dtype=torch.float32):
    w13 = torch.randn(num_experts, 2 * INTER, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(num_experts, H, INTER, generator=gen) / math.sqrt(INTER)
    return w13.to(dtype), w2.to(dtype)


def route(gen, num_tokens, top_k, renormalize=True, unused=(), num_experts=E):
    """Random routing; the experts in `unused` receive no tokens."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, list(unused)] = -math.inf
    return select_experts(logits, top_k, renormalize)


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    if not getattr(k, "has_avx2", False):
        pytest.skip("the compiled CPU matmul needs a C++ compiler and AVX2")
    return k


# ---- routing ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def test_select_experts_matches_transformers_router(arch, dtype):
    torch.manual_seed(0)
    if arch == "mixtral":
        router, renormalize = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E)), True
    else:
        renormalize = arch == "qwen3_moe_norm"
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=E, norm_topk_prob=renormalize))
    router.weight.data.normal_()
    router.to(dtype)
    hidden = torch.randn(200, H).to(dtype)
    with torch.no_grad():
        logits, scores, indices = router(hidden)
    weights, ids = select_experts(logits, router.top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.shape == (200, router.top_k)
    assert torch.equal(ids, indices)
    # Qwen3-MoE rounds the weights to the model dtype; Mixtral keeps them float32.
    assert torch.equal(weights.to(scores.dtype), scores)


def moe_block(arch, top_k, experts_implementation):
    if arch == "mixtral":
        cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=top_k)
        cfg._experts_implementation = experts_implementation
        return MixtralSparseMoeBlock(cfg), True
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=top_k)
    cfg.norm_topk_prob = arch == "qwen3_moe_norm"
    cfg._experts_implementation = experts_implementation
    return Qwen3MoeSparseMoeBlock(cfg), cfg.norm_topk_prob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def test_matches_transformers_moe_block(arch, dtype):
    """Router + experts against the whole transformers block: bit-exact against grouped_mm (the
    implementation transformers' MoE models pick by default), close to the eager loop (which
    index_adds the experts in id order, rounding after each in narrow dtypes)."""
    torch.manual_seed(1)
    block, renormalize = moe_block(arch, 4, "grouped_mm")
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    block.to(dtype)
    hidden = torch.randn(1, 77, H).to(dtype)
    with torch.no_grad():
        expected = block(hidden)[0]
        logits = F.linear(hidden[0], block.gate.weight)
        weights, ids = select_experts(logits, 4, renormalize)
        if arch != "mixtral":
            weights = weights.to(dtype)  # Qwen3-MoE multiplies by weights in the model dtype
        out = fused_experts(hidden[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        assert out.dtype == dtype
        assert torch.equal(out, expected)
        block.experts.config._experts_implementation = "eager"
        eager = block(hidden)[0]
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, eager, **tol)


# ---- the CPU path -----------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference(num_tokens, renormalize, weight_dtype):
    """Without the compiled matmul: bit-exact, since both run the same torch ops on the same rows.
    Experts 2 and 5 receive no tokens; bfloat16-stored weights compute in float32."""
    gen = torch.Generator().manual_seed(num_tokens)
    w13, w2 = make_weights(gen, dtype=weight_dtype)
    weights, ids = route(gen, num_tokens, 3, renormalize, unused=(2, 5))
    hidden = torch.randn(num_tokens, H, generator=gen)
    out = fused_experts(hidden, w13, w2, weights, ids)
    assert out.shape == (num_tokens, H) and out.dtype == torch.float32
    assert torch.equal(out, reference(hidden, w13, w2, weights, ids))


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_path_matches_float64_reference(kernel, num_tokens, weight_dtype):
    """The compiled matmul sums each dot product in its own order (8-lane partial sums), so it
    matches the float64 reference to float32 rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(100 + num_tokens)
    w13, w2 = make_weights(gen, dtype=weight_dtype)
    weights, ids = route(gen, num_tokens, 3, unused=(0,))
    hidden = torch.randn(num_tokens, H, generator=gen)
    out = fused_experts(hidden, w13, w2, weights, ids, cpu_kernels=kernel)
    expected = reference(hidden.double(), w13.double(), w2.double(), weights.double(), ids)
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


class PerExpertKernel:
    """The compiled kernels without the every-expert call: fused_experts then goes expert by expert."""

    def __init__(self, kernel):
        self.small_m_linear = kernel.small_m_linear
        self.silu_and_mul = kernel.silu_and_mul


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_equals_per_expert_kernel(kernel, num_tokens, weight_dtype):
    """grouped_small_m_linear runs the same tiles over each expert's rows as small_m_linear: equal
    bit for bit. At 300 tokens x 2 over 2 live experts each gets more than MAX_KERNEL_ROWS (256)
    rows, and both calls take the per-expert path (the BLAS)."""
    gen = torch.Generator().manual_seed(300 + num_tokens)
    w13, w2 = make_weights(gen, dtype=weight_dtype)
    unused = (1, 2, 4, 5, 6, 7) if num_tokens == 300 else (3,)
    weights, ids = route(gen, num_tokens, 2 if num_tokens == 300 else 3, unused=unused)
    assert (torch.bincount(ids.flatten()).max() > 256) == (num_tokens == 300)
    hidden = torch.randn(num_tokens, H, generator=gen)
    out = fused_experts(hidden, w13, w2, weights, ids, cpu_kernels=kernel)
    assert torch.equal(out, fused_experts(hidden, w13, w2, weights, ids, cpu_kernels=PerExpertKernel(kernel)))


def test_grouped_kernel_checks_offsets(kernel):
    x, w = torch.randn(5, 16), torch.randn(3, 8, 16)
    y = kernel.grouped_small_m_linear(x, w, torch.tensor([0, 2, 2, 5]))
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]))
    with pytest.raises(RuntimeError, match="offsets"):
        kernel.grouped_small_m_linear(x, w, torch.tensor([0, 2, 1, 5]))
    with pytest.raises(RuntimeError, match="offsets"):
        kernel.grouped_small_m_linear(x, w, torch.tensor([0, 2, 2, 4]))


def test_every_pick_remote_gives_zeros(kernel):
    gen = torch.Generator().manual_seed(6)
    w13, w2 = make_weights(gen, num_experts=2)
    weights, ids = route(gen, 4, 2)
    expert_map = torch.tensor([-1] * 6 + [0, 1])  # this rank holds experts 6 and 7
    ids = ids % 6  # ... and no token picked them
    for k in (None, kernel):
        out = fused_experts(
            torch.randn(4, H, generator=gen), w13, w2, weights, ids, expert_map=expert_map, cpu_kernels=k
        )
        assert torch.equal(out, torch.zeros(4, H))


def test_gelu_tanh_activation():
    gen = torch.Generator().manual_seed(3)
    w13, w2 = make_weights(gen)
    weights, ids = route(gen, 9, 2)
    hidden = torch.randn(9, H, generator=gen)
    out = fused_experts(hidden, w13, w2, weights, ids, activation="gelu_pytorch_tanh")
    assert torch.equal(out, reference(hidden, w13, w2, weights, ids, activation="gelu_pytorch_tanh"))
    assert not torch.equal(out, fused_experts(hidden, w13, w2, weights, ids))


def test_expert_map_leaves_out_remote_experts():
    """A rank holding the odd experts: its output is the full layer's with the even experts'
    weights zeroed (y + 0 * z == y), and the two ranks' outputs add up to the full layer's."""
    gen = torch.Generator().manual_seed(4)
    w13, w2 = make_weights(gen)
    weights, ids = route(gen, 40, 4)
    hidden = torch.randn(40, H, generator=gen)
    full = fused_experts(hidden, w13, w2, weights, ids)
    parts = []
    for rank in (0, 1):
        held = torch.arange(rank, E, 2)
        expert_map = torch.full((E,), -1, dtype=torch.long)
        expert_map[held] = torch.arange(len(held))
        out = fused_experts(hidden, w13[held], w2[held], weights, ids, expert_map=expert_map)
        remote = ids % 2 != rank
        assert remote.any() and not remote.all()
        assert torch.equal(out, fused_experts(hidden, w13, w2, weights.masked_fill(remote, 0.0), ids))
        parts.append(out)
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_duplicate_expert_ids_add_both():
    """top-k over distinct experts never repeats one, but ids passed in directly may: both count."""
    gen = torch.Generator().manual_seed(5)
    w13, w2 = make_weights(gen)
    hidden = torch.randn(3, H, generator=gen)
    ids = torch.tensor([[4, 4], [1, 4], [6, 6]])
    weights = torch.tensor([[0.25, 0.5], [0.5, 0.5], [1.0, 1.0]])
    out = fused_experts(hidden, w13, w2, weights, ids)
    assert torch.equal(out, reference(hidden, w13, w2, weights, ids))
    once = fused_experts(hidden, w13, w2, torch.ones(3, 1), ids[:, :1])
    torch.testing.assert_close(out[0], 0.75 * once[0])
    torch.testing.assert_close(out[2], 2 * once[2])


# ---- the Triton grouped GEMM, interpreted -------------------------------------


def test_moe_align_block_size():
    from shoal.workers.model_executor.layers.fused_moe.triton_kernels import moe_align_block_size

    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [7, 1]])
    expert_map = torch.tensor([0, 1, -1, 2, 3, -1, 4, -1])  # 5 and 7 are remote
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 4, 5, expert_map)
    runs = sorted_ids.view(-1, 4).tolist()
    # Local experts 0 (pairs 1, 4), 1 (pair 7), 2 (pairs 0, 2, 5), padded with 8; then the remote run.
    assert runs[:4] == [[1, 4, 8, 8], [7, 8, 8, 8], [0, 2, 5, 8], [3, 6, 8, 8]]
    assert expert_ids[:4].tolist() == [0, 1, 2, -1]
    assert num_post_pad.tolist() == [16]
    assert (sorted_ids[16:] == 8).all() and (expert_ids[4:] == -1).all()


def triton_case(gen, num_tokens, top_k, dtype=torch.float32, weight_dtype=None, unused=()):
    w13, w2 = make_weights(gen, dtype=weight_dtype or dtype)
    weights, ids = route(gen, num_tokens, top_k, unused=unused)
    return torch.randn(num_tokens, H, generator=gen).to(dtype), w13, w2, weights, ids


@pytest.mark.parametrize(("num_tokens", "block_m"), [(1, None), (5, None), (40, None), (40, 64)])
def test_triton_float32(num_tokens, block_m):
    """Experts 1 and 6 get no pairs; 40 tokens x 3 span several blocks of 16 and 64 rows."""
    from shoal.workers.model_executor.layers.fused_moe.triton_kernels import triton_fused_experts

    gen = torch.Generator().manual_seed(200 + num_tokens)
    args = triton_case(gen, num_tokens, 3, unused=(1, 6))
    out = triton_fused_experts(*args, block_m=block_m)
    torch.testing.assert_close(out, reference(*args), rtol=1e-5, atol=1e-5)


def test_triton_bfloat16_and_gelu():
    gen = torch.Generator().manual_seed(7)
    args = triton_case(gen, 23, 2, dtype=torch.bfloat16)
    out = fused_experts(*args, activation="gelu_pytorch_tanh", use_triton=True)
    assert out.dtype == torch.bfloat16
    expected = reference(*args, activation="gelu_pytorch_tanh")
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=1e-2)


def test_triton_bfloat16_weights_float32_activations():
    gen = torch.Generator().manual_seed(8)
    args = triton_case(gen, 6, 2, weight_dtype=torch.bfloat16)
    torch.testing.assert_close(fused_experts(*args, use_triton=True), reference(*args), rtol=1e-5, atol=1e-5)


def test_triton_expert_map_and_duplicate_ids():
    gen = torch.Generator().manual_seed(9)
    hidden, w13, w2, weights, ids = triton_case(gen, 12, 3)
    ids[0] = torch.tensor([2, 2, 5])  # expert 2 twice
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3, -1, -1])
    local13, local2 = w13[[1, 2, 4, 5]], w2[[1, 2, 4, 5]]
    out = fused_experts(hidden, local13, local2, weights, ids, expert_map=expert_map, use_triton=True)
    expected = reference(hidden, local13, local2, weights, ids, expert_map=expert_map)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, fused_experts(hidden, local13, local2, weights, ids, expert_map=expert_map))
