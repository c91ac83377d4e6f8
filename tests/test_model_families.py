"""Every architecture beyond the Llama family, on a tiny random checkpoint
saved by transformers itself: greedy tokens equal transformers' generate in
float32 under the four scheduler regimes, and tensor parallel size 2 on
gloo equals size 1.

An architecture adds its models to FAMILIES: name -> (kind of
tiny_models.KINDS, what the model changes from the kind's tiny shape)."""

from __future__ import annotations

import pytest
import torch
from reference import check_setting, check_tokens, hf_greedy
from regimes import MAX_NEW, SETTINGS, prompts_for, record_prefill_chunks
from tiny_models import make_tiny_model
from tp_helpers import compare_with_k1, tp_prompts

from shoal.workers import LLM, SamplingParams

FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied-mha": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "gemma3": ("gemma3", {}),
    # Gemma 3 4B+'s linear rope scaling on the global layers, and final logit softcapping. (Tied
    # embeddings, as the real ones, make a random tiny model repeat its last token: the 270M GGUF's test ties.)
    "gemma3-linear-rope-softcap": (
        "gemma3",
        {
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        },
    ),
    "qwen3_moe": ("qwen3_moe", {}),
    # a dense MLP on layer 0 (mlp_only_layers), MoE on 1 and 2, top-k weights not renormalised
    "qwen3_moe-dense-first-unnormed": (
        "qwen3_moe",
        {"mlp_only_layers": [0], "norm_topk_prob": False, "num_hidden_layers": 3},
    ),
    "mixtral": ("mixtral", {}),
    "phi3": ("phi3", {}),
    # Phi-4-mini's 3/4 rotary with LongRoPE: every sequence here is within the original context, so both
    # transformers and shoal (max_model_len 1024 <= original) use the short factors; the long ones and the
    # engine-wide choice are tested in test_rotary_scaling.py.
    "phi3-longrope": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 1024,
            "rope_scaling": {
                "rope_type": "longrope",
                "factor": 16.0,
                "short_factor": [1.0, 1.2, 1.7, 2.5, 4.0, 6.0],
                "long_factor": [1.5, 2.5, 4.0, 8.0, 16.0, 32.0],
            },
        },
    ),
    # Phi-3-mini-4k's window on every layer (2047 there), shorter than most prompts here
    "phi3-sliding": ("phi3", {"sliding_window": 50}),
}
# Small caches and token budgets: chunked prefills, decodes, prefix hits and preemptions in one run.
TP_ENGINE = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=48, max_num_seqs=6)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    made = {}
    for name, (kind, overrides) in FAMILIES.items():
        made[name] = make_tiny_model(str(tmp_path_factory.mktemp(f"fam-{name}")), kind, **overrides)
    return made


@pytest.fixture(scope="module")
def hf_family_models(family_models):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in family_models.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(family_models, hf_family_models, name, setting):
    hf = hf_family_models[name]
    llm = LLM(family_models[name], dtype="float32", **SETTINGS[setting])
    chunks = record_prefill_chunks(llm.engine.scheduler)
    prompts = prompts_for(setting, hf.config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    refs = hf_greedy(hf, prompts, MAX_NEW, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    if setting == "chunked":
        assert any(end < prompt_len for _, end, prompt_len in chunks)
    check_setting(llm.engine.stats(), setting, notes)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tensor_parallel_2_equals_1(ray_cluster, family_models, name):
    diff, ref_stats, stats = compare_with_k1(name, family_models[name], 2, tp_prompts(500, n=10), 20, TP_ENGINE)
    assert diff < 1e-3
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert (stats.num_preemptions, stats.num_total_blocks) == (ref_stats.num_preemptions, ref_stats.num_total_blocks)
