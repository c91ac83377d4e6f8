"""The asynchronous front: a background task drives LLMEngine and streams
each request's deltas to its asyncio consumer."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from shoal.proto.errors import EngineDeadError, RequestFailedError, RequestMoved
from shoal.proto.messages import GenerateRequest
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.core.sequence import SequenceStatus
from shoal.workers.engine_args import EngineArgs
from shoal.workers.engine_commands import AbortRequest, AddRequest, EngineCommand, Stall
from shoal.workers.llm_engine import EngineStats, LLMEngine, PendingOutput
from shoal.workers.model_executor.platforms.cpu.openmp import release_thread_team

logger = logging.getLogger(__name__)


def _computing_briefly(fn, *args):
    """fn(*args) on a pool thread that lives on, leaving no OpenMP team there
    beside the engine core's (platforms/cpu/openmp.py)."""
    try:
        return fn(*args)
    finally:
        release_thread_team()


class AsyncEngine:
    """generate() yields RequestOutput deltas; abort() stops a request.

    The engine runs in its own thread (the engine core), step after step with
    no wait on the event loop between them, as vLLM v1's EngineCore busy loop
    does: a loop busy streaming to clients never delays the next step. Adds
    and aborts are queued and applied by that thread between steps, so the
    engine is only ever touched by one thread; each step's outputs reach the
    loop in one call_soon_threadsafe.

    Health: a loop that makes no progress for stall_timeout_s while it has
    work (a hung step, a dead tensor-parallel rank inside a collective) is
    stalled. A watchdog on the event loop notices within a fraction of the
    timeout; the engine is then dead (EngineDeadError), its requests end
    with that error at once, and check_health() raises from then on.

    Async scheduling (EngineArgs.async_scheduling): a second thread, the
    output thread, makes the text of each step's deltas (detokenizing) and
    hands them to the loop, while the core thread already schedules and runs
    the next step. Requests with stop strings are detokenized in the step as
    ever (a stop string ends the request there); their order is kept.
    """

    def __init__(self, engine: LLMEngine, stall_timeout_s: float | None = None):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s or None  # None or 0: not watched
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[EngineCommand] = []  # applied between steps, in order
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        # When the loop last made progress (ran a step, or had nothing to
        # do); written by the engine-core thread, read by the watchdog.
        self._progress_at = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self._unstall = threading.Event()  # ends a stall() early (shutdown)
        self._lora_of: dict[str, int] = {}  # request id -> its adapter's id, from generate() to its end
        self.async_scheduling = bool(getattr(engine.args, "async_scheduling", False))
        engine.defer_outputs = self.async_scheduling
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()  # each step's deliveries, to the output thread
        self._output_thread: threading.Thread | None = None

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs | None = None, stall_timeout_s: float | None = None, **kwargs
    ) -> AsyncEngine:
        return cls(LLMEngine(args or EngineArgs(**kwargs)), stall_timeout_s)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running, counting those added since the last step."""
        return self.engine.scheduler.num_waiting + sum(1 for cmd in self._pending if isinstance(cmd, AddRequest))

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the engine loop, if it stopped."""
        return self._error

    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._progress_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="shoal-engine-core")
            self._thread.start()
            if self.async_scheduling:
                self._output_thread = threading.Thread(target=self._run_outputs, name="shoal-engine-outputs")
                self._output_thread.start()
            if self.stall_timeout_s and self._watchdog is None:
                self._watchdog = self._loop.create_task(self._watch())

    # ---- health ---------------------------------------------------------------

    @property
    def stalled_s(self) -> float:
        """Seconds since the loop last made progress while it had work (0 when
        it is idle or not started)."""
        if self._thread is None or not (self._pending or self.engine.has_unfinished_requests()):
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop failed, stalled past
        stall_timeout_s, or lost a tensor-parallel rank. The first time, every
        request in flight ends with that error (their router fails them over)."""
        if self._error is None:
            try:
                if self.stall_timeout_s and self.stalled_s > self.stall_timeout_s:
                    raise EngineDeadError(
                        f"the engine loop made no progress for {self.stalled_s:.1f} s "
                        f"(stall timeout {self.stall_timeout_s:g} s) while it had work"
                    )
                self.engine.check_health()
            except Exception as e:
                self._fail(e)
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error}") from self._error

    async def _watch(self) -> None:
        """Check the loop's progress a few times per stall timeout, so a
        stall ends its requests soon after the timeout, whenever Serve's next
        health check comes."""
        interval = min(1.0, self.stall_timeout_s / 4)
        while self._error is None and not self._stop:
            await asyncio.sleep(interval)
            try:
                self.check_health()
            except EngineDeadError:
                return

    def _fail(self, error: BaseException) -> None:
        """On the event loop: the engine is dead. Its requests end with an
        EngineDeadError; its thread stops after the step it is in, if that
        ever ends; no request is taken any more."""
        if self._error is None:
            self._error = error
            logger.error("engine dead: %s", error)
        self._stop = True
        self._wake.set()
        err = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine dead: {error}")
        for q in self._queues.values():
            q.put_nowait(err)

    def stall(self, seconds: float) -> None:
        """For tests: block the engine-core thread for `seconds` (ended early
        by shutdown), as a hung step or a dead rank would. The loop really
        stops stepping; only its health checks can tell."""
        self._submit(Stall(seconds))

    # ---- requests -------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas; the last has finish_reason set. The
        request goes on whole (LLMEngine.add_request), its prompt tokenized.
        Bad input raises InvalidRequestError before anything is queued; a
        dead engine raises EngineDeadError (before or amid the deltas). Its
        adapter (lora_name) is registered already: add_lora, or the worker's."""
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error}") from self._error
        lora = self.engine.check_request(request, in_flight=self._queues)
        request_id, params = request.request_id, request.params
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            self._queues[request_id] = queue  # inside the try: every way out removes it
            if lora is not None:  # in use from here: an unload is refused (remove_named_lora)
                self._lora_of[request_id] = lora.lora_int_id
            grammar = None
            if params.structured_outputs is not None:  # compiled on the grammar threads, never in a step
                grammar = await self.engine.structured_output.compile_async(params.structured_outputs)
            self._ensure_loop()
            self._submit(AddRequest(request, grammar))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not queue.empty():  # the consumer lagged: send one merged delta
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        raise later
                    item.merge(later)
                if item.error is not None:  # this request failed alone in the engine (LLMEngine._fail)
                    finished = True
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (cancelled, closed)
                self.abort(request_id)
            self._queues.pop(request_id, None)
            self._lora_of.pop(request_id, None)

    # ---- LoRA adapters served by name (the worker's runtime loads) ---------------

    async def add_lora(self, lora_request) -> None:
        """LLMEngine.register_lora, its files read and checked off the event loop."""
        await asyncio.to_thread(_computing_briefly, self.engine.register_lora, lora_request)

    async def add_named_lora(self, request, root: str | None = None) -> None:
        """LLMEngine.add_named_lora, its files read off the event loop."""
        await asyncio.to_thread(_computing_briefly, self.engine.add_named_lora, request, root)

    def num_lora_requests(self, name: str) -> int:
        """Requests under the adapter served as `name`, from generate() to
        their end (those still checking the adapter or queued included)."""
        request = self.engine.lora_by_name.get(name)
        if request is None:
            return 0
        return sum(1 for i in list(self._lora_of.values()) if i == request.lora_int_id)

    def remove_named_lora(self, name: str):
        """LLMEngine.remove_named_lora, counting the requests not in the
        engine yet (checking the adapter, queued for the next step) as in use."""
        return self.engine.remove_named_lora(name, in_flight=self.num_lora_requests(name))

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the next step."""
        self._submit(AbortRequest(request_id))

    def release_waiting(self, keep: int) -> list[str]:
        """Hand back the newest waiting requests past the first `keep` that
        have never been scheduled (no token, nothing computed): each stream
        raises RequestMoved at once, and the request is aborted. Preempted
        requests (they have tokens) stay. Returns the ids handed back.

        The scheduler's queue is read on the event loop while the engine
        thread steps, so a request may be scheduled before its abort lands: its stream may then carry a
        token before RequestMoved, which the router resumes from as after
        a failover."""
        waiting = sorted(list(self.engine.scheduler.waiting))  # (priority, arrival order, seq); a copy is atomic
        movable = [
            seq.request_id
            for _, _, seq in waiting
            if seq.status is SequenceStatus.WAITING and seq.request_id in self._queues
        ]
        moved = movable[max(0, len(movable) - max(0, len(waiting) - keep)) :]
        for request_id in moved:
            self._queues[request_id].put_nowait(RequestMoved(f"request {request_id} handed back to move"))
            self.abort(request_id)
        return moved

    def _submit(self, cmd: EngineCommand) -> None:
        with self._lock:
            if isinstance(cmd, AddRequest) and not (self._pending or self.engine.has_unfinished_requests()):
                self._progress_at = time.monotonic()  # work arrives: the stall clock starts now
            self._pending.append(cmd)
        self._wake.set()

    # ---- the engine-core thread ----------------------------------------------

    def _apply_pending(self) -> list:
        with self._lock:
            pending, self._pending = self._pending, []
        delivered = []
        for cmd in pending:
            if isinstance(cmd, Stall):
                self._unstall.wait(cmd.seconds)
            elif isinstance(cmd, AddRequest):
                try:
                    self.engine.add_request(cmd.request, cmd.grammar)
                except Exception as e:  # validated already; never let one request stop the loop
                    delivered.append((cmd.request.request_id, e))
            else:
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    delivered.append((cmd.request_id, out))
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
                    steps = self.engine.num_steps
                    delivered += [(out.request_id, out) for out in self.engine.step()]
                    if delivered or self.engine.num_steps != steps:
                        self._progress_at = time.monotonic()
                else:
                    self._progress_at = time.monotonic()  # nothing to do is no stall
                if self._error is not None:  # declared dead while in a step: its outputs go nowhere
                    return
                if delivered:
                    if self._loop.is_closed():  # the owner's loop ended without shutdown()
                        return
                    if self.async_scheduling:
                        self._outputs.put(delivered)
                    else:
                        self._loop.call_soon_threadsafe(self._deliver, delivered)
                elif not self.engine.has_unfinished_requests():
                    self._wake.wait(0.25)  # wakes now and then to notice a closed loop or shutdown
                    self._wake.clear()
                    if self._loop.is_closed():
                        return
        except Exception as e:
            logger.exception("engine loop failed")
            self._error = e
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail, EngineDeadError(f"engine loop failed: {e}"))
        except BaseException:  # interpreter shutdown
            pass

    def _run_outputs(self) -> None:
        """The output thread: each step's deltas get their text, in step
        order, and go to the loop. Ends once the core thread has ended and
        everything it handed over is delivered."""
        core = self._thread
        while True:
            try:
                items = self._outputs.get(timeout=0.25)
            except queue.Empty:
                if core is None or not core.is_alive():
                    return
                continue
            if items is None:
                return
            done = []
            for request_id, item in items:
                if isinstance(item, PendingOutput):
                    item = self._resolve(item)
                done.append((request_id, item))
            if self._error is not None or self._loop.is_closed():
                continue  # dead: its requests have their error already
            self._loop.call_soon_threadsafe(self._deliver, done)

    def _resolve(self, pending: PendingOutput) -> RequestOutput:
        """The delta with its text; a detokenizer that raises ends its request
        alone, as it would inside the step (LLMEngine._fail)."""
        try:
            return pending.resolve()
        except Exception as e:
            out = pending.out
            logger.warning("request %s failed alone: %s: %s", out.request_id, type(e).__name__, e)
            if not out.finished:
                self._submit(AbortRequest(out.request_id))  # its blocks go before the next step
            message = f"request {out.request_id} failed in the engine: {type(e).__name__}: {e}"
            return RequestOutput(
                out.request_id,
                [],
                "",
                "error",
                out.num_prompt_tokens,
                out.num_cached_tokens,
                out.num_output_tokens,
                out.timings,
                error=message,
            )

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
            self._unstall.set()
            thread.join(timeout)
            self._thread = None
        if self._output_thread is not None:
            self._outputs.put(None)  # after all the core thread handed over
            self._output_thread.join(timeout)
            self._output_thread = None

    async def shutdown(self) -> None:
        """Stop the engine-core thread (after the step in progress), then the
        engine's other tensor-parallel ranks, if any."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        await asyncio.to_thread(self._stop_thread)
        self.engine.shutdown()
