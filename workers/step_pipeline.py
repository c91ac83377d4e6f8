"""Async scheduling's compute thread (vLLM's async scheduling, on one rank).

With --async-scheduling the engine core computes each step on a thread of
its own and, while it runs, schedules and stages the next one: the sequences
due a token get a placeholder for it (Scheduler.advance_ahead), the next
step's inputs are staged with the placeholders in place, and the step's
sampled tokens are put in them just before that step's forward
(ModelRunner.run_prepared). The scheduling, staging and bookkeeping of a step
thus run while the one before computes, instead of between the two.

Every forward of such an engine runs on this one thread (a sync step's too),
so the process keeps one OpenMP team (platforms/cpu/openmp.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.model_executor.runner.interface import PreparingRunner


@dataclass(slots=True)
class InFlight:
    """The step computing now."""

    sched: SchedulerOutput
    future: Future  # -> (its output, the seconds it took)
    ahead_ok: bool  # whether the next step may be scheduled before its tokens are known


class StepPipeline:
    def __init__(self, runner: PreparingRunner):
        self.runner = runner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shoal-engine-compute")
        self.inflight: InFlight | None = None
        self.num_ahead = 0  # steps launched before the step before had its tokens (placeholders filled)

    def call(self, fn, *args):
        """fn(*args) on the compute thread, waited for."""
        return self._pool.submit(fn, *args).result()

    def launch(self, sched: SchedulerOutput, prep, previous: ModelRunnerOutput | None, ahead_ok: bool) -> None:
        """Start computing a prepared step; previous: the output its placeholders come from."""
        assert self.inflight is None, "one step computes at a time"
        self.num_ahead += previous is not None
        self.inflight = InFlight(sched, self._pool.submit(self._run, prep, previous), ahead_ok)

    def _run(self, prep, previous: ModelRunnerOutput | None) -> tuple[ModelRunnerOutput, float]:
        t0 = time.perf_counter()
        out = self.runner.run_prepared(prep, previous)
        return out, time.perf_counter() - t0

    def wait(self) -> tuple[ModelRunnerOutput, float]:
        """The step in flight's output and time (its error raised); nothing is in flight after."""
        cur = self.inflight
        assert cur is not None, "no step in flight"
        try:
            return cur.future.result()
        finally:
            self.inflight = None

    def shutdown(self) -> None:
        """Let a step in flight end, then stop the thread."""
        self._pool.shutdown(wait=True)
