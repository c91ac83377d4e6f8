"""The compiled CPU kernels of a decode step (platforms/cpu/csrc/: the few-row
GEMM, RMSNorm, SiLU-and-multiply, rotary embedding, and every decoder layer
in one call) against the pure-torch path, which stays the reference."""

from __future__ import annotations

import gc
import math
import random
import weakref

import pytest
import torch
import torch.nn.functional as F

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.attention import set_forward_context
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels
from shoal.workers.model_executor.platforms.cpu.bind import bind as bind_cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed? a compiler error in the log?)"
    return k


# ---- small_m_linear -------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("K", [16, 576])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_matches_float64_reference(kernel, wdtype, K, bias):
    # M: the 3-row tiles' remainders (1, 2 left over) and the 48-row blocks of x;
    # N: the 4-row tiles of w and the single rows after them.
    gen = torch.Generator().manual_seed(K + bias)
    for N in (1, 3, 4, 5, 64, 131):
        w = torch.randn(N, K, generator=gen).to(wdtype)
        b = torch.randn(N, generator=gen) if bias else None
        for M in (1, 2, 3, 4, 5, 47, 48, 49, 100):
            x = torch.randn(M, K, generator=gen)
            ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
            y = kernel.small_m_linear(x, w, b)
            assert y.shape == (M, N) and y.dtype == torch.float32
            torch.testing.assert_close(
                y,
                ref,
                rtol=1e-5,
                atol=1e-4 * math.sqrt(K),
                msg=lambda m: f"M={M} N={N} K={K} {wdtype} bias={bias}: {m}",
            )


def test_small_m_linear_rows_do_not_depend_on_the_batch(kernel):
    """From 8 rows up, float32 weights go through the outer-product tiles,
    which sum each output in k order whatever the tiling: a row's result is
    the same bits in a batch of 8 as of 130 (16-row panels, an 8-row tail,
    a second block of 64), and at one thread as at two."""
    gen = torch.Generator().manual_seed(5)
    K, N = 576, 133  # N: 6-row weight groups and a tail of 1
    w = torch.randn(N, K, generator=gen)
    x = torch.randn(130, K, generator=gen)
    isa, threads = kernel.set_isa("avx2"), torch.get_num_threads()  # the tiles are the AVX2 build's
    try:
        full = kernel.small_m_linear(x, w, None)
        for M in (8, 9, 16, 17, 24, 64, 65, 100):
            assert torch.equal(kernel.small_m_linear(x[:M], w, None), full[:M]), f"M={M}"
        torch.set_num_threads(1)
        assert torch.equal(kernel.small_m_linear(x, w, None), full)
    finally:
        kernel.set_isa(isa)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_strided_rows_and_bf16_bias(kernel, wdtype):
    gen = torch.Generator().manual_seed(1)
    K, N, M = 64, 37, 7
    base = torch.randn(M, K + 16, generator=gen)
    x = base[:, 8 : 8 + K]  # rows K + 16 apart, as a slice of a wider activation
    w = torch.randn(N, K, generator=gen).to(wdtype)
    b = torch.randn(N, generator=gen).to(wdtype)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(kernel.small_m_linear(x, w, b), ref, rtol=1e-5, atol=1e-4 * math.sqrt(K))


def test_small_m_linear_refuses_bad_inputs(kernel):
    w = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.small_m_linear(torch.randn(2, 24), torch.randn(8, 24), None)
    with pytest.raises(RuntimeError, match="float32 activations"):
        kernel.small_m_linear(torch.randn(2, 32, dtype=torch.float64), w, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\], w \[N, K\]"):
        kernel.small_m_linear(torch.randn(2, 48), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 weights"):
        kernel.small_m_linear(torch.randn(2, 32), w.half(), None)
    with pytest.raises(RuntimeError, match="contiguous weights"):
        kernel.small_m_linear(torch.randn(2, 32), torch.randn(32, 8).t(), None)


def test_small_ops_refuse_mismatched_shapes(kernel):
    """Shapes the model never passes must raise, not read or write past a buffer."""
    x, w = torch.randn(4, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="same shape"):
        kernel.rms_norm(x, torch.randn(2, 64), w, 1e-5)
    with pytest.raises(RuntimeError, match="same shape"):
        kernel.rms_norm(torch.randn(2, 64), torch.randn(2, 32), w, 1e-5)
    with pytest.raises(RuntimeError, match="hidden size"):
        kernel.rms_norm(x, None, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="even width"):
        kernel.silu_and_mul(torch.randn(2, 7))
    cos = sin = torch.randn(10, 16)
    with pytest.raises(RuntimeError, match="T positions"):
        kernel.rotary_embedding(torch.tensor([1]), torch.randn(3, 2, 16), torch.randn(3, 1, 16), cos, sin)
    with pytest.raises(RuntimeError, match=r"tables \[max_pos, D\]"):
        kernel.rotary_embedding(torch.tensor([1]), torch.randn(1, 2, 32), torch.randn(1, 1, 32), cos, sin)


# ---- rms_norm ---------------------------------------------------------------


def _reference_norm(w: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(w.shape[0], eps)  # cpu_kernels None: the torch path
    norm.weight.data.copy_(w)
    return norm


@pytest.mark.parametrize("H", [64, 67])  # 67: the AVX loop's tail
@pytest.mark.parametrize("T", [1, 5, 40])  # 40: more rows than the threads' grain
def test_rms_norm_matches_torch_path(kernel, T, H):
    gen = torch.Generator().manual_seed(T * H)
    eps = 1e-5
    w = torch.randn(H, generator=gen)
    ref = _reference_norm(w, eps)
    x = torch.randn(T, H, generator=gen) * 3
    residual = torch.randn(T, H, generator=gen)

    with torch.no_grad():
        out = kernel.rms_norm(x, None, w, eps)
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
        assert out.data_ptr() != x.data_ptr()

        exp_out, exp_res = ref(x.clone(), residual.clone())
        xk, rk = x.clone(), residual.clone()
        got = kernel.rms_norm(xk, rk, w, eps)
        assert got.data_ptr() == xk.data_ptr(), "the normed sum is written into x"
        assert torch.equal(rk, residual + x), "the residual becomes residual + x, in place"
        torch.testing.assert_close(rk, exp_res, rtol=0, atol=0)
        torch.testing.assert_close(xk, exp_out, rtol=1e-5, atol=1e-5)

        # The module with the kernels returns the same pair as its torch path.
        fused = _reference_norm(w, eps)
        fused.cpu_kernels = kernel
        xm, rm = x.clone(), residual.clone()
        out_m, res_m = fused(xm, rm)
        torch.testing.assert_close(out_m, exp_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res_m, exp_res, rtol=0, atol=0)


def test_rms_norm_honours_row_strides(kernel):
    gen = torch.Generator().manual_seed(7)
    T, H, pad, eps = 20, 67, 13, 1e-6
    w = torch.randn(H, generator=gen)
    ref = _reference_norm(w, eps)
    base = torch.randn(T, H + pad, generator=gen)
    x = base[:, 5 : 5 + H]  # rows H + pad apart, unit stride along hidden
    rbase = torch.randn(T, H + 2 * pad, generator=gen)
    residual = rbase[:, :H]
    assert x.stride() == (H + pad, 1) and not x.is_contiguous()

    with torch.no_grad():
        torch.testing.assert_close(kernel.rms_norm(x, None, w, eps), ref(x.contiguous()), rtol=1e-5, atol=1e-5)

        exp_out, exp_res = ref(x.clone(), residual.clone())
        base_before, rbase_before = base.clone(), rbase.clone()
        kernel.rms_norm(x, residual, w, eps)
        torch.testing.assert_close(x, exp_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(residual, exp_res, rtol=0, atol=0)
        # Nothing outside the views was written.
        assert torch.equal(base[:, :5], base_before[:, :5]) and torch.equal(base[:, 5 + H :], base_before[:, 5 + H :])
        assert torch.equal(rbase[:, H:], rbase_before[:, H:])


# ---- silu_and_mul -----------------------------------------------------------


@pytest.mark.parametrize("N", [8, 13, 69])  # 13, 69: not a multiple of the 8-wide vectors
@pytest.mark.parametrize("T", [1, 3, 40])  # 40: more rows than the threads' grain
@pytest.mark.parametrize("scale", [1.0, 100.0])  # +-100: exp's clamping
def test_silu_and_mul_matches_torch(kernel, T, N, scale):
    gen = torch.Generator().manual_seed(T * N)
    x = (torch.rand(T, 2 * N, generator=gen) * 2 - 1) * scale
    if scale > 1:
        # exp's clamp edges (-87.3, 88.3) and beyond, and zero
        edges = torch.tensor([-100.0, -90.0, -88.5, -87.3, -80.0, 0.0, 80.0, 88.3, 90.0, 100.0])
        x[0, : min(N, edges.numel())] = edges[: min(N, edges.numel())]
    gate, up = x.split(N, dim=-1)
    ref = F.silu(gate) * up
    out = kernel.silu_and_mul(x)
    assert out.shape == (T, N)
    assert torch.isfinite(out).all(), out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_strided_rows(kernel):
    gen = torch.Generator().manual_seed(3)
    T, N = 17, 21
    base = torch.randn(T, 2 * N + 6, generator=gen) * 10
    x = base[:, 3 : 3 + 2 * N]
    gate, up = x.split(N, dim=-1)
    torch.testing.assert_close(kernel.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


# ---- rotary_embedding -------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,D", [(4, 2, 32), (3, 1, 12), (2, 2, 64)])
@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]
)
def test_rotary_embedding_in_place_on_fused_qkv(kernel, heads, kv_heads, D, scaling):
    max_pos = 300
    rot = RotaryEmbedding(D, max_pos, 10000.0, scaling)  # cpu_kernels None: the torch path
    positions = torch.tensor([0, 5, 299, 17, 130, 1, 64, 200, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    T = positions.numel()  # 20: more rows than the threads' grain
    q_size, kv_size = heads * D, kv_heads * D
    qkv = torch.randn(T, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(D))
    before = qkv.clone()

    def split(t):  # as LlamaAttention does
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(-1, heads, D), k.view(-1, kv_heads, D), v

    q_ref, k_ref = rot(positions, *split(before.clone())[:2])
    rot.cpu_kernels = kernel
    q, k, _ = split(qkv)
    assert q.stride(0) == q_size + 2 * kv_size  # views of the fused output, not copies
    q_out, k_out = rot(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "rotated in place"
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :]), "v untouched"


def test_rotary_embedding_refuses_out_of_range_positions(kernel):
    D, max_pos = 16, 32
    rot = RotaryEmbedding(D, max_pos, 10000.0, None)
    for bad in ([0, max_pos], [-1, 3]):
        q, k = torch.randn(2, 2, D), torch.randn(2, 1, D)
        q0, k0 = q.clone(), k.clone()
        with pytest.raises(RuntimeError, match="out of range"):
            kernel.rotary_embedding(torch.tensor(bad), q, k, rot.cos_cached, rot.sin_cached)
        assert torch.equal(q, q0) and torch.equal(k, k0), "nothing rotated before the check"


# ---- the whole decode step ---------------------------------------------------


def _llm(tiny_model, backend: str, weight_dtype: str = "auto") -> LLM:
    # No prefix caching: each step's mix of prefills and decodes follows from the prompts alone.
    llm = LLM(
        tiny_model,
        num_kv_blocks=256,
        attention_backend=backend,
        enable_prefix_caching=False,
        dtype="float32",  # bfloat16 weights widened, on every CPU (platforms/cpu/precision.py)
        weight_dtype=weight_dtype,
    )
    runner = llm.engine.runner
    if backend == "torch":
        assert runner.cpu_decode_step is None
        assert all(getattr(m, "cpu_kernels", None) is None for m in runner.model.modules())
    else:
        assert runner.cpu_decode_step is not None, "the CPU kernels did not build"
    return llm


def test_no_cpu_kernels_leaves_every_layer_on_the_torch_path(tiny_model):
    """EngineArgs.cpu_kernels off (--no-cpu-kernels, or SHOAL_CPU_KERNEL=0's default): nothing is bound."""
    runner = LLM(tiny_model, num_kv_blocks=64, cpu_kernels=False).engine.runner
    assert runner.attn_backend.name == "torch" and runner.cpu_decode_step is None
    assert all(getattr(m, "cpu_kernels", None) is None for m in runner.model.modules())
    with pytest.raises(RuntimeError, match="cpu_kernels on"):
        LLM(tiny_model, num_kv_blocks=64, attention_backend="cpu_kernel", cpu_kernels=False)


class _PathSpy:
    """Counts the runner's forwards through the C++ layers (one call per step)
    and through the model's per-layer modules (layer 0's forward, one per step)."""

    def __init__(self, runner, monkeypatch):
        self.fused = self.per_layer = 0
        step, model = runner.cpu_decode_step, runner.model
        bound, layer0 = step.bound_layers, model.layers[0].forward

        def spy_bound():
            self.fused += 1
            return bound()

        def spy_layer0(*args, **kwargs):
            self.per_layer += 1
            return layer0(*args, **kwargs)

        monkeypatch.setattr(step, "bound_layers", spy_bound)
        monkeypatch.setattr(model.layers[0], "forward", spy_layer0)

    def counts(self) -> tuple[int, int]:
        return self.fused, self.per_layer


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _assert_same_logprobs(got, ref):
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-4)
        assert a.top_logprobs.keys() == b.top_logprobs.keys()
        for t in a.top_logprobs:
            assert a.top_logprobs[t] == pytest.approx(b.top_logprobs[t], rel=1e-4, abs=1e-4)


def test_batched_generation_matches_torch_backend(kernel, tiny_model, monkeypatch):
    prompts = _prompts(11, (1, 7, 40, 130))
    ref = _llm(tiny_model, "torch").generate(prompts, GREEDY)
    llm = _llm(tiny_model, "auto")
    step = llm.engine.runner.cpu_decode_step
    assert step._bound is None
    spy = _PathSpy(llm.engine.runner, monkeypatch)
    outs = llm.generate(prompts, GREEDY)
    for p, o, r in zip(prompts, outs, ref):
        assert o.token_ids == r.token_ids, f"prompt of {len(p)} tokens"
        _assert_same_logprobs(o, r)
    # Step 1 prefills (and starts the one-token prompt) through the layers;
    # the other 11 steps are 4-row decodes, each one call of the C++ layers.
    assert spy.counts() == (GREEDY.max_tokens - 1, 1)
    assert step._bound is not None


@pytest.mark.parametrize("n", [1, 6, 50])
def test_single_prompt_generation_matches_torch_backend(kernel, tiny_model, monkeypatch, n):
    prompts = _prompts(100 + n, (n,))
    ref = _llm(tiny_model, "torch").generate(prompts, GREEDY)
    llm = _llm(tiny_model, "auto")
    spy = _PathSpy(llm.engine.runner, monkeypatch)
    out = llm.generate(prompts, GREEDY)
    assert out[0].token_ids == ref[0].token_ids
    _assert_same_logprobs(out[0], ref[0])
    # A one-token prompt is a one-token row: every step, the first too, is decode-only.
    steps = GREEDY.max_tokens
    assert spy.counts() == ((steps, 0) if n == 1 else (steps - 1, 1))


def _stepwise(llm: LLM, spy: _PathSpy | None) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """A (20-token prompt) prefills alone, B (9 tokens) joins at A's first decode,
    then both decode: step 2 mixes a prefill with a decode."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = _prompts(21, (20, 9))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    paths = []

    def step():
        before = spy.counts() if spy else (0, 0)
        deltas = engine.step()
        after = spy.counts() if spy else (0, 0)
        paths.append((after[0] - before[0], after[1] - before[1]))
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)
        return {d.request_id for d in deltas}

    engine.add_request(GenerateRequest("a", engine.tokenize(a), params))
    assert step() == {"a"}
    engine.add_request(GenerateRequest("b", engine.tokenize(b), params))
    assert step() == {"a", "b"}, "A's decode and B's prefill in one step"
    while engine.has_unfinished_requests():
        step()
    return tokens, paths


def test_mixed_prefill_and_decode_step_takes_the_per_layer_path(kernel, tiny_model, monkeypatch):
    ref, _ = _stepwise(_llm(tiny_model, "torch"), None)
    llm = _llm(tiny_model, "auto")
    spy = _PathSpy(llm.engine.runner, monkeypatch)
    got, paths = _stepwise(llm, spy)
    assert got == ref
    assert len(got["a"]) == len(got["b"]) == 6
    # (C++ layer calls, per-layer forwards) per step: A's prefill, A's decode
    # with B's prefill, then 2-row decodes until B's 6th token (A's came a step earlier).
    assert paths[0] == (0, 1) and paths[1] == (0, 1), paths
    assert paths[2:] == [(1, 0)] * (len(paths) - 2) and len(paths) == 7, paths


class _BothPaths:
    """Runs every forward of the runner twice on the same inputs (and the same
    KV cache): first through the model's layers with the compiled kernels
    unbound (the torch path), then as the runner would (the one-call decode
    step or the layers with the kernels); records both logits and returns the
    kernels'."""

    def __init__(self, runner, monkeypatch):
        self.records: list[tuple[bool, torch.Tensor, torch.Tensor]] = []  # (decode-only, torch, kernels)
        model, step = runner.model, runner.cpu_decode_step
        kernels = step.kernels
        forward, step_forward = model.forward, step.forward

        def torch_path(input_ids, positions, logits_indices):
            bind_cpu_kernels(model, None)
            try:
                return forward(input_ids, positions, logits_indices)
            finally:
                assert bind_cpu_kernels(model, kernels) is kernels

        def both(input_ids, positions, logits_indices):
            ref = torch_path(input_ids, positions, logits_indices)
            out = forward(input_ids, positions, logits_indices)
            self.records.append((False, ref.clone(), out.clone()))
            return out

        def both_decode_only(input_ids, positions, logits_indices, meta):
            with set_forward_context(meta):  # the layers' attention reads it
                ref = torch_path(input_ids, positions, logits_indices)
            out = step_forward(input_ids, positions, logits_indices, meta)
            self.records.append((True, ref.clone(), out.clone()))
            return out

        monkeypatch.setattr(model, "forward", both)
        monkeypatch.setattr(step, "forward", both_decode_only)


@pytest.mark.parametrize("weight_dtype", ["auto", "bfloat16"])
def test_logits_of_kernel_and_torch_paths_agree(kernel, tiny_model, monkeypatch, weight_dtype):
    """bfloat16 weights: the torch path widens the same stored weights, so
    the two paths differ only in summation order there too."""
    llm = _llm(tiny_model, "auto", weight_dtype)
    both = _BothPaths(llm.engine.runner, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(_prompts(31, (3, 20, 70, 1)), params)
    llm.generate(_prompts(32, (45,)), params)
    decode_only = [r for r in both.records if r[0]]
    assert len(decode_only) == 8 and len(both.records) == 10, [r[0] for r in both.records]
    for i, (fused, ref, out) in enumerate(both.records):
        assert out.shape == ref.shape and out.shape[0] in (1, 4)
        scale = ref.abs().max().item()
        torch.testing.assert_close(
            out,
            ref,
            rtol=1e-4,
            atol=1e-4 * scale,
            msg=lambda m: f"forward {i} (decode-only: {fused}), |logits| up to {scale:.1f}: {m}",
        )


def test_release_kv_cache_drops_the_binding(kernel, tiny_model):
    llm = _llm(tiny_model, "auto")
    runner = llm.engine.runner
    step = runner.cpu_decode_step
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(_prompts(41, (5, 9)), params)
    assert step._bound is not None

    cache = weakref.ref(runner.kv_cache)
    runner.release_kv_cache()
    assert step._bound is None
    gc.collect()
    assert cache() is None, "something still holds the released KV cache"

    # A new cache binds anew, and generation over it is still the torch path's.
    runner.initialize_kv_cache(llm.engine.args.num_kv_blocks)
    prompts = _prompts(42, (5, 9))
    out = llm.generate(prompts, params)
    assert step._bound is not None
    ref = _llm(tiny_model, "torch").generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
