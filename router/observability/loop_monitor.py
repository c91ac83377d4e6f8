"""How late this router's event loop runs, and what holds it.

One event loop serves a router's HTTP, gRPC, /health and every stream's
deltas: a callback that holds it delays them all. Two watchers:

- a coroutine that sleeps `interval_s` at a time and measures how late it
  wakes (the loop's lag). The gauge shoal:router_event_loop_lag_seconds
  reads the largest lag of about the last `window_s`: a scrape is itself
  served by the loop, so the latest lag alone would nearly always read 0.
  When it wakes after a stall longer than `block_s` it logs the stall's length.
- a watchdog thread that, once the loop has not come back for more than
  `block_s`, logs a warning with the loop thread's stack and the request
  id of the task holding it, once per stall. The fronts name a request's
  task after it (name_task); elsewhere (a stream's pump, a delta stream's
  reader) the nearest frame with a request id in hand tells it.

What it costs: a task renamed per request; 1/interval_s wake-ups a second of
the coroutine and 2/block_s of the thread, whatever the load.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from typing import cast

logger = logging.getLogger(__name__)

REQUEST_TASK_PREFIX = "request "
STACK_FRAMES = 25  # the innermost frames of the loop thread a report shows


def name_task(request_id: str) -> None:
    """Name the running task after the request it serves."""
    task = asyncio.current_task()
    if task is not None:
        task.set_name(REQUEST_TASK_PREFIX + request_id)


def request_of(task: asyncio.Task | None, frame) -> str | None:
    """The request id of a task named by name_task, else the nearest one
    in hand on the stack (a local `request_id` or `rid`), else None."""
    if task is not None:
        name = task.get_name()
        if name.startswith(REQUEST_TASK_PREFIX):
            return name[len(REQUEST_TASK_PREFIX) :]
    while frame is not None:
        local = frame.f_locals
        for key in ("request_id", "rid"):
            value = local.get(key)
            if isinstance(value, str):
                return value
        frame = frame.f_back
    return None


class LoopMonitor:
    def __init__(self, interval_s: float = 0.05, block_s: float = 0.1, window_s: float = 60.0):
        self.interval_s, self.block_s, self.window_s = interval_s, block_s, window_s
        self.last_lag_s = 0.0  # the latest wake-up's lag
        self.num_stalls = 0  # stalls the watchdog reported
        self._peak = (0.0, float("-inf"))  # (largest lag of the window, when)
        self._beat: float | None = None  # monotonic time of the coroutine's latest wake-up
        self._stall_request: str | None = None  # the request the watchdog found holding the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Watch the running loop (again a no-op while watching)."""
        if self._task is not None:
            return
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._beat = time.monotonic()
        self._stop = threading.Event()  # a thread of an earlier start sees its own, set
        self._task = self._loop.create_task(self._ticks(), name="shoal-loop-monitor")
        threading.Thread(target=self._watch, args=(self._stop,), name="shoal-loop-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()  # the thread ends at its next wake-up
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def lag_s(self) -> float:
        """What the gauge reads: the largest lag of the window, or the stall
        under way when the loop is held now (read from another thread)."""
        now = time.monotonic()
        peak, at = self._peak
        held = 0.0 if self._beat is None or self._task is None else now - self._beat - self.interval_s
        return max(peak if now - at <= self.window_s else self.last_lag_s, held, 0.0)

    async def _ticks(self) -> None:
        interval = self.interval_s
        while True:
            # Measured from the last beat (start()'s, the first time): a loop held before this
            # task first ran counts too.
            await asyncio.sleep(interval)
            now = time.monotonic()
            lag = max(0.0, now - cast(float, self._beat) - interval)  # start() set it
            self.last_lag_s = lag
            peak, at = self._peak
            if lag >= peak or now - at > self.window_s:
                self._peak = (lag, now)
            if lag > self.block_s:
                rid, self._stall_request = self._stall_request, None
                logger.warning("the event loop came back after %.3f s held (request %s)", lag, rid or "unknown")
            self._beat = time.monotonic()

    def _watch(self, stop: threading.Event) -> None:
        reported = None  # the beat whose stall was reported
        while not stop.wait(self.block_s / 2):
            beat = cast(float, self._beat)  # start() set it
            held = time.monotonic() - beat - self.interval_s
            if held > self.block_s and beat != reported:
                reported = beat
                self._report(held)

    def _report(self, held: float) -> None:
        frame = sys._current_frames().get(cast(int, self._loop_thread))
        task = asyncio.current_task(self._loop)  # the task running on the loop now (reading it is safe here)
        rid = request_of(task, frame)
        self._stall_request = rid
        self.num_stalls += 1
        stack = "".join(traceback.format_stack(frame, limit=STACK_FRAMES)) if frame is not None else ""
        logger.warning(
            "the event loop has been held for %.0f ms (request %s, task %s); the loop thread is at:\n%s",
            held * 1000,
            rid or "unknown",
            task.get_name() if task is not None else None,
            stack.rstrip(),
        )
