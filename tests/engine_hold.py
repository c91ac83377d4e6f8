"""A hook that holds a real worker's engine: it runs a given number of steps,
then steps no more until something is submitted to it (an add or an abort)
or the test releases it. Tests hold work with it instead of sizing it by time."""

from __future__ import annotations

import asyncio

HOLD_LIMIT_S = 30.0  # a hold nothing ends lets the engine go on (the test has failed by then)


class EngineHold:
    def __init__(self, worker, steps: int = 0):
        self.aeng = worker.engine
        self.eng = self.aeng.engine
        self._real = self.eng.step
        self.left = steps
        self.eng.step = self._step

    def _step(self):
        if self.left > 0:
            self.left -= 1
            return self._real()
        aeng, waited = self.aeng, 0.0
        while not aeng._pending and not aeng._stop and self.left <= 0 and waited < HOLD_LIMIT_S:
            aeng._wake.wait(0.5)
            aeng._wake.clear()
            waited += 0.5
        if waited >= HOLD_LIMIT_S:
            self.release()
        return []

    def release(self) -> None:
        """Step freely from now on."""
        self.eng.step = self._real
        self.left = 1 << 62
        self.aeng._wake.set()

    def held(self, steps: int) -> bool:
        """It has run `steps` steps and holds a request."""
        return self.eng.num_steps >= steps and bool(self.eng.requests)

    def gone(self, request_ids: list[str]) -> bool:
        """None of request_ids is left in the worker, and every KV block is free."""
        s = self.aeng.stats()
        return (
            not any(r in self.aeng._queues or r in self.eng.requests for r in request_ids)
            and s.num_free_blocks == s.num_total_blocks
        )


async def until(cond, timeout: float = 10.0) -> float:
    """Seconds until cond() held, polled on the event loop (inf if it never did)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < timeout:
        if cond():
            return loop.time() - t0
        await asyncio.sleep(0.005)
    return float("inf")
