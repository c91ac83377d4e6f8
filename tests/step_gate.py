"""A gate on a real worker's engine: it steps only as often as the test lets
it (one step per grant). A reader that grants a step per delta it takes then
gets one token per delta, never several merged (AsyncEngine merges a lagging
reader's deltas), however fast or slow the machine."""

from __future__ import annotations

import threading

GATE_LIMIT_S = 30.0  # a step no grant comes for goes on (the test has failed by then)


class StepGate:
    def __init__(self, worker):
        self.aeng = worker.engine
        self.eng = self.aeng.engine
        self._real = self.eng.step
        self._grants = threading.Semaphore(0)
        self.eng.step = self._step

    def _step(self):
        aeng, waited = self.aeng, 0.0
        while waited < GATE_LIMIT_S:
            if aeng._pending or aeng._stop:  # adds and aborts go in between steps, as ever
                return []
            if self._grants.acquire(timeout=0.05):
                if aeng._pending:  # submitted before this grant (an abort, say): it goes first
                    self._grants.release()
                    return []
                break
            waited += 0.05
        return self._real()

    def grant(self, steps: int = 1) -> None:
        self._grants.release(steps)

    def remove(self) -> None:
        self.eng.step = self._real
