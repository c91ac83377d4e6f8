"""Greedy tokens equal transformers' generate(do_sample=False), token for
token, on tiny random models, under the four scheduler regimes."""

from __future__ import annotations

import pytest
import torch
from reference import check_setting, check_tokens, hf_greedy
from regimes import MAX_NEW, SETTINGS, prompts_for, record_prefill_chunks

from shoal.workers import LLM, SamplingParams


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in tiny_models.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("variant", ["llama-gqa-untied", "llama-tied-bias", "qwen2-bias-mha", "mistral", "llama3-rope"])
def test_greedy_matches_transformers(tiny_models, hf_models, variant, setting):
    hf = hf_models[variant]
    llm = LLM(tiny_models[variant], dtype="float32", **SETTINGS[setting])
    chunks = record_prefill_chunks(llm.engine.scheduler)
    prompts = prompts_for(setting, hf.config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    refs = hf_greedy(hf, prompts, MAX_NEW, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    if setting == "chunked":
        # Prompts were split: some chunk ended before its prompt did, then
        # the prompt went on from there in a later step.
        budget = SETTINGS["chunked"]["max_num_batched_tokens"]
        assert max(len(p) for p in prompts) > budget
        assert any(end < prompt_len for _, end, prompt_len in chunks)
        assert any(0 < start < prompt_len for start, _, prompt_len in chunks)
        assert all(end - start <= budget for start, end, _ in chunks)
    check_setting(llm.engine.stats(), setting, notes)
