"""The four scheduler regimes every token-exact test walks through (plain,
preemption, chunked prefill, prefix sharing): engine settings, prompts that
exercise each, and the record of the prompt chunks a run scheduled."""

from __future__ import annotations

import random

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
