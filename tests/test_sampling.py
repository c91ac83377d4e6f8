"""Per-request sampling: seeds, filters, penalties, stops and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.workers import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_kv_blocks=512)


def rand_prompt(rng, n):
    return [rng.randrange(3, 500) for _ in range(n)]


def test_seed_same_alone_and_batched_with_31_others(llm):
    rng = random.Random(0)
    prompt = rand_prompt(rng, 40)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    others = [rand_prompt(rng, rng.randrange(1, 120)) for _ in range(31)]
    other_params = [
        SamplingParams(
            temperature=rng.choice([0, 0.7, 1.3]),
            top_k=rng.choice([-1, 5]),
            seed=rng.choice([None, 7]),
            max_tokens=rng.randrange(1, 30),
        )
        for _ in others
    ]
    batch = llm.generate([others[0], prompt] + others[1:], [other_params[0], params] + other_params[1:])
    assert batch[1].token_ids == alone
    # a different seed gives different tokens
    assert (
        llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True))[
            0
        ].token_ids
        != alone
    )


def test_top_k_1_is_greedy(llm):
    prompt = rand_prompt(random.Random(2), 30)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    top1 = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))[0]
    assert top1.token_ids == greedy


def test_top_p_and_min_p_keep_only_the_head(llm):
    prompt = rand_prompt(random.Random(3), 30)
    # With a tiny top_p (or min_p near 1) only the most likely token survives.
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    for p in (
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.999999, max_tokens=10, ignore_eos=True),
    ):
        assert llm.generate(prompt, p)[0].token_ids == greedy


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    prompt = rand_prompt(random.Random(4), 20)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_at = out.token_ids[3]
    first = out.token_ids.index(stop_at)
    out2 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[stop_at]))[0]
    assert out2.token_ids == out.token_ids[: first + 1] and out2.finish_reason == "stop"
    # min_tokens bans the stop token until reached
    out3 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7, min_tokens=7, stop_token_ids=[stop_at]))[0]
    assert len(out3.token_ids) == 7 and stop_at not in out3.token_ids


def test_stop_string_cuts_text(llm):
    prompt = rand_prompt(random.Random(5), 20)
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_repetition_penalty_matches_transformers(llm, tiny_model):
    # presence/frequency penalties are checked by hand in test_layers.py
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(random.Random(6), 25)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = hf.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=12,
        repetition_penalty=1.3,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    ours = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3))[
        0
    ].token_ids
    assert ours == ref


def test_logprobs_are_the_model_distribution(llm, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(random.Random(7), 15)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == 3
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    for i, tl in enumerate(out.logprobs):
        row = lp[len(prompt) - 1 + i]
        assert tl.token_id == out.token_ids[i]
        assert abs(tl.logprob - row[tl.token_id].item()) < 1e-4
        assert set(tl.top_logprobs) == set(row.topk(5).indices.tolist())
