"""Greedy tokens equal transformers' generate(do_sample=False), token for
token, on tiny random models, under the four scheduler regimes."""

from __future__ import annotations

import random

import pytest
import torch
from reference import check_setting, check_tokens, hf_greedy

from shoal.workers import LLM, SamplingParams

MAX_NEW = 16
SETTINGS = {
    "plain": dict(num_kv_blocks=1024),
    # 30 blocks of 16 for 16 prompts up to 600 tokens: sequences get preempted.
    "preempt": dict(num_kv_blocks=40),
    # a 48-token budget splits every long prompt into chunks
    "chunked": dict(num_kv_blocks=1024, max_num_batched_tokens=48),
    "prefix": dict(num_kv_blocks=1024),
}


def prompts_for(setting: str, vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    if setting == "prefix":
        shared = [rng.randrange(vocab) for _ in range(200)]
        return [
            shared[: rng.randrange(100, 201)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            for _ in range(16)
        ]
    lengths = [1, 2, 5, 17, 31, 64, 100, 150, 200, 256, 300, 350, 420, 480, 550, 600]
    if setting == "preempt":
        rng.shuffle(lengths)  # long and short interleaved: running sequences outgrow the cache
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


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


def record_prefill_chunks(scheduler) -> list[tuple[int, int, int]]:
    """(first, end, prompt length) of every prompt piece each step schedules."""
    chunks, schedule = [], scheduler.schedule

    def recording():
        out = schedule()
        for seq, n in out.scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                chunks.append((seq.num_computed_tokens, seq.num_computed_tokens + n, seq.num_prompt_tokens))
        return out

    scheduler.schedule = recording
    return chunks
