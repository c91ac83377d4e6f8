"""Iteration-level scheduling: every step builds a new batch under one
token budget, running sequences first, then waiting ones."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256  # sequences in one step at most

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(slots=True)
class SchedulerOutput:
    """The step's batch: each sequence with its number of new tokens, which
    run from its num_computed_tokens. A decode has 1, a prefill chunk more."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        # (priority, arrival_order, seq): arrival_order is unique, so the
        # Sequence itself is never compared. A preempted sequence keeps its
        # place, so it goes back ahead of later arrivals.
        self.waiting: list[tuple[int, int, Sequence]] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.priority, seq.arrival_order, seq))

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stop, length or abort) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting = [w for w in self.waiting if w[2] is not seq]
            heapq.heapify(self.waiting)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: drop the KV and prefill it again later (the
        # prefix cache often still holds most of it).
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        heapq.heappush(self.waiting, (seq.priority, seq.arrival_order, seq))
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        picked: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, n), in order
        bm = self.block_manager

        # Running sequences: decodes first, so a long prefill chunk never
        # takes the budget that in-flight replies need.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, n):
                victim = max(self.running, key=Sequence.sort_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if id(victim) in picked:
                    budget += picked.pop(id(victim))[1]
                if victim is seq:
                    break
            else:
                picked[id(seq)] = (seq, n)
                budget -= n
        out.scheduled = list(picked.values())

        # Waiting sequences, in (priority, arrival) order; none join in a
        # step that had to preempt, since memory is short.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][2]
            hits = bm.get_computed_blocks(seq)
            n = min(seq.num_tokens - len(hits) * bm.block_size, budget)
            if not bm.allocate_slots(seq, n, hits):
                break
            heapq.heappop(self.waiting)
            if seq.timings is not None and seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.time()
                seq.num_cached_tokens = len(hits) * bm.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out
