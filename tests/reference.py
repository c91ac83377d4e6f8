"""transformers as the reference: greedy generate and the near-tie check."""

from __future__ import annotations

import torch

from shoal.benchmarks.tp import first_difference


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int]) -> list[list[int]]:
    """transformers' generate(do_sample=False), one prompt at a time (no
    padding, so nothing but the weights shapes the numbers)."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
        )
        outs.append(y[0, len(ids) :].tolist())
    return outs


def check_tokens(model, prompt: list[int], ours: list[int], ref: list[int], tie_tol: float = 1e-4) -> str | None:
    """None when equal. At the first difference, the reference's top two
    logits there must be within tie_tol (a near-tie, where summation order
    decides); returns a note saying so, else raises AssertionError."""
    if ours == ref:
        return None
    n = min(len(ours), len(ref))
    if ours[:n] == ref[:n]:
        raise AssertionError(f"lengths differ ({len(ours)} vs {len(ref)}) with equal tokens up to {n}")
    i, gap = first_difference(model, prompt, ours, ref)
    assert gap < tie_tol, f"token {i} differs ({ours[i]} vs {ref[i]}) and the reference's top-2 gap is {gap:.3g}"
    return f"near-tie at token {i}: top-2 gap {gap:.2e}"


def check_setting(stats, setting: str, notes: list) -> None:
    """What each scheduler regime of the token-exact tests must show."""
    if setting == "preempt":
        assert stats.num_preemptions > 0
    if setting == "prefix":
        assert stats.prefix_cache_hit_rate > 0.3
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back once idle
    assert sum(n is not None for n in notes) <= 1, notes
