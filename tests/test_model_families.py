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
