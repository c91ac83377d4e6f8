"""A stand-in model step for scheduler tests: every scheduled token is
computed at once and each sequence due a token gets a made-up one, so
the scheduler's own update_from_output does all the bookkeeping."""

from __future__ import annotations

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import Scheduler
from shoal.workers.core.sequence import Sequence


def stand_in_step(sched: Scheduler, budget_check: int | None = None) -> list[Sequence]:
    """One engine step; returns the sequences that finished in it."""
    out = sched.schedule()
    if budget_check is not None:
        assert out.num_batched_tokens <= budget_check
    seqs = out.seqs_due_token
    tokens = [(s.num_tokens * 13) % 50 for s in seqs]
    return sched.update_from_output(out, ModelRunnerOutput(seqs, tokens, [None] * len(seqs)))
