"""How the router reaches its workers: a Ray Serve handle in the cluster, or
Worker objects in this process (tests, benchmarks of the router itself)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from shoal.proto.messages import GenerateDelta, GenerateRequest, Riding, WorkerError, WorkerInfo, WorkerLoad
from shoal.router.routing import policies, rebalance, replica_stats
from shoal.router.routing.delta_mux import DeltaMux, MuxEnded
from shoal.router.routing.failover import WorkerLost
from shoal.router.routing.replica_stats import ReplicaStats
from shoal.router.routing.stream_buffer import StreamBuffer

logger = logging.getLogger(__name__)


def _take_in(stats: ReplicaStats, request_id: str, msg, first: bool) -> None:
    """What a worker's message tells the router: the worker has the request
    (its first message), and the worker's load as of its latest step."""
    if first:
        stats.ack(request_id)
    load = getattr(msg, "load", None)  # a WorkerError has none
    if load is not None:
        stats.observe_worker_load(load)


_END = object()  # a request's own stream ended


async def _pump(gen, inbox: StreamBuffer) -> None:
    """A request's own stream into its inbox: its deltas until it rides, a
    refusal, its end, or its error."""
    try:
        async for msg in gen:
            inbox.put(msg)
        inbox.put(_END)
    except Exception as e:
        inbox.put(e)


class ServeWorkerPool:
    """The worker deployment behind a Serve DeploymentHandle. The deployment's
    request router (request_router.py, --routing) picks the replica;
    the load riding on each delta feeds its figures (replica_stats.REGISTRY),
    the freshest it has under load. Deltas come back on this router's one
    stream per worker (delta_mux.py) once it is open there."""

    def __init__(self, handle, router_id: str | None = None, max_buffer_tokens: int | None = None):
        """max_buffer_tokens: what a request's inbox holds for a client that does not read (delta_mux.py)."""
        self._stream = handle.options(method_name="generate", stream=True, _by_reference=False)
        self._handle = handle
        self.mux = DeltaMux(handle, router_id, max_buffer_tokens)
        # A new worker takes over requests still waiting on deeper queues.
        self._rebalancer = rebalance.start(handle)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta | WorkerError, None]:
        stats, mux, rid = replica_stats.REGISTRY, self.mux, request.request_id
        request.mux = mux.router_id
        done, first, worker, pump, gen = False, True, None, None, None
        cancelled = False  # the request's own stream was cancelled: aborted at its worker

        def overflow(tokens: int) -> None:
            """Its client stopped reading: abort it at its worker now, not when the client next reads."""
            nonlocal cancelled
            logger.warning(
                "%s aborted: its client read none of its last %d tokens (--max-stream-buffer-tokens %d)",
                request.log_name,
                tokens,
                mux.max_buffer_tokens,
            )
            mux.close(rid, worker)
            if pump is not None:
                pump.cancel()
            if gen is not None and not cancelled:
                cancelled = True
                gen.cancel()

        try:
            inbox = mux.open(rid, overflow)
            gen = self._stream.remote(request)
            # The own stream is read into the inbox whether or not the client reads: what
            # waits for a slow client is the inbox's, merged and bounded (stream_buffer.py).
            pump = asyncio.get_running_loop().create_task(_pump(gen, inbox))
            while True:
                msg = await inbox.get()
                if isinstance(msg, Riding):  # its deltas come on this router's delta stream from here
                    worker = msg.worker
                    if not mux.ride(rid, worker):
                        raise WorkerLost(f"the delta stream from worker {worker} ended")
                    continue
                if isinstance(msg, MuxEnded):
                    raise WorkerLost(f"worker {worker}'s delta stream: {msg.error}") from msg.error
                if isinstance(msg, BaseException):  # StreamBufferFull too
                    raise msg
                if msg is _END:
                    if worker is None:  # the own stream carried it all and ended
                        done = True
                        return
                    continue  # riding: the own stream ended; the last delta is on its way here
                _take_in(stats, rid, msg, first)
                load = getattr(msg, "load", None)
                if first and worker is None and load is not None:
                    mux.connect(load.worker)  # this router's next requests there ride
                first = False
                yield msg
                if isinstance(msg, WorkerError) or msg.finished is not None:
                    done = True
                    return
        finally:
            stats.done(rid)  # the router reserved it when it chose the replica
            mux.close(rid, worker)
            if pump is not None:
                pump.cancel()
            if not done and gen is not None and not cancelled:  # the client went away: abort in the engine
                gen.cancel()

    async def info(self) -> WorkerInfo:
        info = await self._handle.options(method_name="info").remote()
        replica_stats.REGISTRY.block_size = info.block_size  # the request router's, in this process
        return info

    async def stats(self) -> list[WorkerLoad | BaseException]:
        """Every live worker's stats, read now (a control-plane broadcast)."""
        resp = self._handle.broadcast("stats")
        return await resp.results_async(timeout_s=5.0, return_exceptions=True)

    # A control-plane call may read an adapter's files: it gets longer than the stats poll.
    BROADCAST_TIMEOUT_S = 120.0

    async def broadcast(self, method: str, *args) -> list:
        """Every live worker's answer to `method`."""
        resp = self._handle.broadcast(method, *args)
        return await resp.results_async(timeout_s=self.BROADCAST_TIMEOUT_S, return_exceptions=True)


class LocalWorkerPool:
    """Workers in this process, chosen as the cluster's request router would
    (policies/, `kv` by default; `pow2`'s own rule over these figures) over
    figures of their own: the loads on their deltas, and their routing stats
    read every POLL_S where the policy reads any."""

    POLL_S = 0.2

    def __init__(self, workers: list, policy: str = policies.DEFAULT_POLICY):
        """policy: a --routing name; any other raises ValueError."""
        self.workers = workers
        self.policy = policies.get_policy(policy)
        self.replica_stats = ReplicaStats()  # this pool's own, not the process's
        self._polled = -self.POLL_S
        self._turn = 0

    def _names(self) -> list[str]:
        # A test's stand-in for a worker may have no name (nor routing stats).
        return [getattr(w, "name", f"worker-{i}") for i, w in enumerate(self.workers)]

    def _poll(self, names: list[str]) -> None:
        if not policies.reads_reports(self.policy):
            return
        now = time.monotonic()
        if now - self._polled >= self.POLL_S:
            self._polled = now
            for name, w in zip(names, self.workers):
                if hasattr(w, "record_routing_stats"):
                    self.replica_stats.observe_poll(name, w.record_routing_stats())

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta | WorkerError, None]:
        stats, names = self.replica_stats, self._names()
        self._poll(names)
        if self.policy.needs_prefix and not stats.block_size and hasattr(self.workers[0], "info"):
            stats.block_size = self.workers[0].info().block_size
        order = policies.route(stats, self.policy, request, names, [stats.get(n) for n in names], self._turn)
        self._turn += 1
        worker = self.workers[order[0]]
        first = True
        try:
            async with aclosing(worker.generate(request)) as stream:
                async for msg in stream:
                    _take_in(stats, request.request_id, msg, first)
                    first = False
                    yield msg
        finally:
            stats.done(request.request_id)

    async def info(self) -> WorkerInfo:
        info = self.workers[0].info()
        self.replica_stats.block_size = info.block_size
        return info

    async def stats(self) -> list[WorkerLoad | BaseException]:
        await asyncio.sleep(0)
        return [w.stats() for w in self.workers]

    async def broadcast(self, method: str, *args) -> list:
        out = []
        for w in self.workers:
            try:
                result = getattr(w, method)(*args)
                out.append(await result if inspect.isawaitable(result) else result)
            except Exception as e:
                out.append(e)
        self._polled = -self.POLL_S  # what the call changed is in the next routing
        return out
