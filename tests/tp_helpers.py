"""Running one workload at tensor-parallel size 1 and K, recording the
logits rank 0 samples from, so tests can compare tokens and logits."""

from __future__ import annotations

import random

import torch

from shoal.workers import LLM, SamplingParams


class LogitRecorder:
    """Wraps a runner's sampler; keeps a copy of every step's logits."""

    def __init__(self, sampler):
        self.sampler, self.steps = sampler, []

    def __call__(self, logits, sampling_metadata):
        self.steps.append(logits.clone())
        return self.sampler(logits, sampling_metadata)


def tp_prompts(vocab: int, n: int = 10, seed: int = 0) -> list[list[int]]:
    """Prompts of 1 to ~150 tokens; half share a 40-token prefix (prefix cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 5, 17, 60, 110]))]
        out.append(shared + tail if i % 2 else tail)
    return out


def run_recorded(
    model: str, tp: int, prompts, max_tokens: int, lora_request=None, **engine
) -> tuple[list[list[int]], list, object]:
    """Greedy tokens, per-step logits and the engine's final stats."""
    with LLM(model, tensor_parallel_size=tp, **engine) as llm:
        rec = llm.engine.runner.sampler = LogitRecorder(llm.engine.runner.sampler)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=lora_request)
        stats = llm.engine.stats()
    return [o.token_ids for o in outs], rec.steps, stats


def max_logit_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |difference| over the steps both runs share in shape (they
    schedule alike while their tokens agree)."""
    diffs = [(x - y).abs().max().item() for x, y in zip(a, b) if x.shape == y.shape]
    return max(diffs) if diffs else float("nan")


def compare_with_k1(label: str, model: str | None, k: int, prompts, max_tokens: int, engine: dict, lora_request=None):
    """Runs K = 1 and K = k; asserts equal greedy tokens, prints and returns
    the largest logit difference with both runs' stats."""
    ref, ref_logits, ref_stats = run_recorded(model, 1, prompts, max_tokens, lora_request, **engine)
    got, got_logits, stats = run_recorded(model, k, prompts, max_tokens, lora_request, **engine)
    diff = max_logit_diff(ref_logits, got_logits)
    print(f"\n{label}: K={k} vs K=1 on {len(prompts)} prompts, largest logit difference {diff:.2e}")
    assert got == ref
    return diff, ref_stats, stats
