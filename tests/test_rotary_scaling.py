"""Partial rotary and Phi-3's LongRoPE against transformers: the inverse
frequencies and attention factor against its rope init functions, the
rotation (torch, compiled CPU and fused Triton paths) against Phi-3's own
apply_rotary_pos_emb, and the engine's choice of short or long factors
against transformers' generate on both sides of the original context."""

from __future__ import annotations

import json
import os
import random
import shutil

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before fused_ops is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from reference import check_tokens, hf_greedy
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.phi3 import phi3_rope_scaling

SHORT = [1.0, 1.3, 2.0, 3.5]  # 4 factors: head_dim 16, half of it rotated
LONG = [1.5, 2.5, 4.0, 8.0]
ORIGINAL = 64


def _phi3_config(partial: float, rope: dict | None, **extra):
    from transformers import Phi3Config

    head_dim = 32
    n = int(head_dim * partial) // 2
    if rope is not None and rope.get("rope_type", rope.get("type")) == "longrope":
        rope = {**rope, "short_factor": [1.0 + 0.5 * i for i in range(n)], "long_factor": [2.0 + i for i in range(n)]}
    return Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=extra.pop("max_position_embeddings", 4096),
        partial_rotary_factor=partial,
        rope_scaling=rope,
        pad_token_id=None,
        **extra,
    )


def _ours(hf_config, max_positions: int) -> tuple[torch.Tensor, float]:
    cfg = ModelConfig.from_hf_dict(hf_config.to_dict())
    rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    return rope_inv_freq(rotary_dim, cfg.rope_theta, phi3_rope_scaling(cfg), max_positions)


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_partial_rotary_inv_freq_matches_transformers(partial):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf = _phi3_config(partial, None)
    ref, ref_scale = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    ours, scale = _ours(hf, 4096)
    assert ours.shape == (int(32 * partial) // 2,)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert scale == ref_scale == 1.0


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize(
    "extra",
    [{}, {"factor": 8.0}, {"attention_factor": 1.25}],
    ids=["factor-from-lengths", "explicit-factor", "explicit-attention-factor"],
)
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_matches_transformers(partial, extra, long):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _phi3_config(partial, {"rope_type": "longrope", **extra}, original_max_position_embeddings=ORIGINAL)
    # transformers' dynamic update asks for the long factors with seq_len original + 1
    ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=ORIGINAL + 1 if long else None)
    ours, scale = _ours(hf, 1024 if long else ORIGINAL)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    assert scale != 1.0  # 4096 / 64 or the explicit factors: something to get wrong
    other, _ = _ours(hf, ORIGINAL if long else 1024)
    assert not torch.allclose(ours, other)  # the two sets differ: the choice is tested


def test_published_phi3_config_old_keys_and_top_level_original_context():
    """A Phi-3-mini-128k config.json as published: rope_scaling with the old
    key "type", the original context at the top level only."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = _phi3_config(1.0, {"type": "longrope"}, max_position_embeddings=131072).to_dict()
    rope = d.pop("rope_parameters")
    d["rope_scaling"] = {"type": "longrope", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    d["original_max_position_embeddings"] = 4096
    hf = Phi3Config(**d)
    assert hf.rope_parameters["rope_type"] == "longrope"
    for long, max_positions in ((False, 4096), (True, 131072)):
        ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097 if long else None)
        cfg = ModelConfig.from_hf_dict(d)
        ours, scale = rope_inv_freq(cfg.head_dim, cfg.rope_theta, phi3_rope_scaling(cfg), max_positions)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale, rel=1e-12) and scale > 1.0


def _hf_rotation(hf_config, positions, q, k):
    """Phi-3's own rotary module and apply_rotary_pos_emb on [T, heads, dim] q and k."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cos, sin = Phi3RotaryEmbedding(hf_config)(q, positions[None])
    # [1, heads, T, dim] as transformers lays them out
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


def _qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """Views into one fused q/k/v output, as the attention layer passes them."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(seed))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    return qkv, q, k


ROTATIONS = {
    "partial-default": (0.5, None, 4096),
    "partial-longrope-short": (0.75, {"rope_type": "longrope"}, ORIGINAL),
    "partial-longrope-long": (0.75, {"rope_type": "longrope"}, 300),
    "full-longrope-long": (1.0, {"rope_type": "longrope"}, 300),
}


def _rotary_for(name: str, fused_ops: bool = False):
    partial, rope, max_positions = ROTATIONS[name]
    hf = _phi3_config(partial, rope, original_max_position_embeddings=ORIGINAL)
    cfg = ModelConfig.from_hf_dict(hf.to_dict())
    rotary = RotaryEmbedding(
        cfg.head_dim,
        max_positions,
        cfg.rope_theta,
        phi3_rope_scaling(cfg),
        fused_ops,
        rotary_dim=int(cfg.head_dim * partial),
    )
    positions = torch.tensor([0, 1, 5, 17, 40, 63] + ([64, 100, 299] if max_positions > ORIGINAL else []))
    return hf, rotary, positions


@pytest.mark.parametrize("name", list(ROTATIONS))
def test_rotation_matches_transformers(name):
    hf, rotary, positions = _rotary_for(name)
    _, q, k = _qkv(len(positions), 4, 2, 32, seed=1)
    q_ref, k_ref = _hf_rotation(hf, positions, q, k)
    out_q, out_k = rotary.forward_native(positions, q, k)
    torch.testing.assert_close(out_q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, k_ref, rtol=1e-5, atol=1e-5)
    r = rotary.rotary_dim
    assert torch.equal(out_q[..., r:], q[..., r:])  # the rest passes through


@pytest.mark.parametrize("name", list(ROTATIONS))
def test_compiled_cpu_rotation_in_place_on_the_rotated_dims(name):
    from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None or not getattr(kernels, "has_avx2", False):
        pytest.skip("the compiled CPU kernels are not available here")
    hf, rotary, positions = _rotary_for(name)
    qkv, q, k = _qkv(len(positions), 4, 2, 32, seed=2)
    q_ref, k_ref = _hf_rotation(hf, positions, q.clone(), k.clone())
    before = qkv.clone()
    rotary.cpu_kernels = kernels
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr(), "rotated in place"
    torch.testing.assert_close(out_q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 4 * 32 + 2 * 32 :], before[:, 4 * 32 + 2 * 32 :]), "v untouched"


@pytest.mark.parametrize("name", list(ROTATIONS))
def test_fused_triton_rotation(monkeypatch, name):
    pytest.importorskip("triton", reason="the fused ops need the triton package")
    from shoal.workers.model_executor.layers import fused_ops

    calls = []
    op = fused_ops.rotary_embedding
    monkeypatch.setattr(fused_ops, "rotary_embedding", lambda *a: calls.append(1) or op(*a))
    hf, rotary, positions = _rotary_for(name, fused_ops=True)
    qkv, q, k = _qkv(len(positions), 4, 2, 32, seed=3)
    q_ref, k_ref = _hf_rotation(hf, positions, q, k)
    before = qkv.clone()
    out_q, out_k = rotary(positions, q, k)
    assert calls == [1]
    assert torch.equal(qkv, before)  # new tensors, as the torch path returns
    torch.testing.assert_close(out_q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, k_ref, rtol=1e-5, atol=1e-5)


# ---- the engine: which factors a served sequence gets -------------------------


@pytest.fixture(scope="module")
def longrope_models(tmp_path_factory) -> tuple[str, str]:
    """A tiny Phi-3 with LongRoPE (original context 64 of 1024), and a copy
    whose short factors are its long ones (transformers then always uses the long)."""
    path = make_tiny_model(
        str(tmp_path_factory.mktemp("phi3-longrope")),
        "phi3",
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    )
    always_long = str(tmp_path_factory.mktemp("phi3-always-long"))
    shutil.copytree(path, always_long, dirs_exist_ok=True)
    with open(os.path.join(always_long, "config.json")) as f:
        d = json.load(f)
    d["rope_parameters"]["short_factor"] = LONG
    with open(os.path.join(always_long, "config.json"), "w") as f:
        json.dump(d, f)
    return path, always_long


def _prompts(lengths: list[int]) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _check_greedy(shoal_path: str, hf_path: str, prompts, max_tokens: int, **engine) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    llm = LLM(shoal_path, dtype="float32", num_kv_blocks=128, num_threads=1, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    refs = hf_greedy(hf, prompts, max_tokens, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_within_the_original_context_short_factors_as_transformers(longrope_models):
    """max_model_len <= the original context: every sequence stays within
    it, and transformers uses the short factors throughout."""
    path, _ = longrope_models
    _check_greedy(path, path, _prompts([1, 7, 20, 44]), 20, max_model_len=ORIGINAL)


def test_beyond_the_original_context_long_factors_as_transformers(longrope_models):
    """max_model_len > the original context: the long factors for every
    position, which is what transformers uses for a prompt beyond the original context."""
    path, _ = longrope_models
    _check_greedy(path, path, _prompts([65, 90, 200]), 16)


def test_a_long_context_engine_gives_short_sequences_the_long_factors(longrope_models):
    """The documented difference: on an engine serving beyond the original
    context, a short sequence gets the long factors too (transformers would
    switch sets once it grew past 64 and recompute its cache)."""
    path, always_long = longrope_models
    _check_greedy(path, always_long, _prompts([3, 20, 40]), 16)
