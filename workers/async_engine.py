"""The asynchronous front: a background task drives LLMEngine and streams
each request's deltas to its asyncio consumer."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

from shoal.workers.config import EngineArgs
from shoal.workers.llm_engine import EngineStats, LLMEngine
from shoal.workers.outputs import RequestOutput
from shoal.workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """generate() yields RequestOutput deltas; abort() stops a request.

    Steps run in a worker thread so the event loop stays free to accept and
    stream; requests are added and aborted on the loop between steps, so the
    engine itself is only ever touched by one thread at a time.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list = []  # ("add", args) / ("abort", request_id), applied between steps
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
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
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

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
        self._pending.append(("add", (request_id, prompt_ids, params, priority)))
        self._ensure_loop()
        self._wake.set()
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
        self._pending.append(("abort", request_id))
        self._wake.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for kind, arg in pending:
            if kind == "add":
                try:
                    self.engine.add_request(*arg)
                except Exception as e:  # validated already; never let one request stop the loop
                    self._deliver_error(arg[0], e)
            else:
                out = self.engine.abort_request(arg)
                if out is not None and arg in self._queues:
                    self._queues[arg].put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(error)

    async def _run(self) -> None:
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    if not self._pending:
                        await self._wake.wait()
                    continue
                outputs = await asyncio.to_thread(self.engine.step)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
        except Exception as e:
            logger.exception("engine loop failed")
            self._error = e
            for rid in list(self._queues):
                self._deliver_error(rid, RuntimeError(f"engine loop failed: {e}"))

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
