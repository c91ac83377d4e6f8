"""The asynchronous front: a background task drives LLMEngine and streams
each request's deltas to its asyncio consumer."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator

from shoal.workers.engine_args import EngineArgs
from shoal.workers.llm_engine import EngineStats, LLMEngine
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """generate() yields RequestOutput deltas; abort() stops a request.

    The engine runs in its own thread (the engine core), step after step with
    no wait on the event loop between them, as vLLM v1's EngineCore busy loop
    does: a loop busy streaming to clients never delays the next step. Adds
    and aborts are queued and applied by that thread between steps, so the
    engine is only ever touched by one thread; each step's outputs reach the
    loop in one call_soon_threadsafe.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list = []  # ("add", args) / ("abort", request_id), applied between steps
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, **kwargs) -> "AsyncEngine":
        return cls(LLMEngine(args or EngineArgs(**kwargs)))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running, counting those added since the last step."""
        return self.engine.scheduler.num_waiting + sum(1 for kind, _ in self._pending if kind == "add")

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the engine loop, if it stopped."""
        return self._error

    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="shoal-engine-core")
            self._thread.start()

    async def generate(self, request_id: str | None, prompt: str | list[int],
                       params: SamplingParams | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Stream one request's deltas; the last has finish_reason set.
        Bad input raises InvalidRequestError before anything is queued."""
        if self._error is not None:
            raise RuntimeError("the engine loop has failed") from self._error
        request_id = request_id or f"req-{next(self._ids)}"
        params = params or SamplingParams()
        if request_id in self._queues or request_id in self.engine.requests:
            from shoal.workers.errors import InvalidRequestError

            raise InvalidRequestError(f"request_id {request_id!r} is already in use", field="request_id")
        prompt_ids = self.engine.tokenize(prompt)
        self.engine.validate(prompt_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._ensure_loop()
        self._submit(("add", (request_id, prompt_ids, params, priority)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not queue.empty():  # the consumer lagged: send one merged delta
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        raise later
                    item.merge(later)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (cancelled, closed)
                self.abort(request_id)
            self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the next step."""
        self._submit(("abort", request_id))

    def _submit(self, op: tuple) -> None:
        with self._lock:
            self._pending.append(op)
        self._wake.set()

    # ---- the engine-core thread ----------------------------------------------

    def _apply_pending(self) -> list:
        with self._lock:
            pending, self._pending = self._pending, []
        delivered = []
        for kind, arg in pending:
            if kind == "add":
                try:
                    self.engine.add_request(*arg)
                except Exception as e:  # validated already; never let one request stop the loop
                    delivered.append((arg[0], e))
            else:
                out = self.engine.abort_request(arg)
                if out is not None:
                    delivered.append((arg, out))
        return delivered

    def _run(self) -> None:
        # The thread is not a daemon: a daemon thread still inside torch when
        # the interpreter finalizes (freeing tensors, say) is killed mid-C++
        # and takes the process down. Instead it ends by itself once the main
        # thread has finished (interpreter shutdown marks it stopped before
        # joining the other threads), within one wait at most.
        main = threading.main_thread()
        try:
            while not self._stop and main.is_alive():
                delivered = self._apply_pending()
                if self.engine.has_unfinished_requests():
                    delivered += [(out.request_id, out) for out in self.engine.step()]
                if delivered:
                    if self._loop.is_closed():  # the owner's loop ended without shutdown()
                        return
                    self._loop.call_soon_threadsafe(self._deliver, delivered)
                elif not self.engine.has_unfinished_requests():
                    self._wake.wait(0.25)  # wakes now and then to notice a closed loop or shutdown
                    self._wake.clear()
                    if self._loop.is_closed():
                        return
        except Exception as e:
            logger.exception("engine loop failed")
            self._error = e
            err = RuntimeError(f"engine loop failed: {e}")
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._deliver, [(rid, err) for rid in list(self._queues)])
        except BaseException:  # interpreter shutdown
            pass

    def _deliver(self, items: list) -> None:
        """On the event loop: hand each output (or error) to its consumer."""
        for request_id, item in items:
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(item)

    def _stop_thread(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            self._stop = True
            self._wake.set()
            thread.join(timeout)
            self._thread = None

    async def shutdown(self) -> None:
        """Stop the engine-core thread (after the step in progress), then the
        engine's other tensor-parallel ranks, if any."""
        await asyncio.to_thread(self._stop_thread)
        self.engine.shutdown()
