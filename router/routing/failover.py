"""Failover: a request whose worker is lost goes on on another worker, and
its client sees one uninterrupted stream.

FailoverPool wraps a worker pool (ServeWorkerPool, LocalWorkerPool) behind
the same interface. A worker is lost when its process dies or its node goes
(Ray raises RayActorError, ActorUnavailableError included, from the stream),
or when it reports its engine dead (WorkerError 'unavailable': a failed or
stalled loop, a dead tensor-parallel rank). The request is then sent again:
its prompt plus every token already streamed, marked as resumed output
(GenerateRequest.num_resumed_tokens and _chars). The new worker's engine
counts those tokens as output, so the token budget, min_tokens, penalties,
stop strings (whose text may span the seam) and each sampled token's draw
(a hash of the seed and the output index) go on as if nothing happened. It
streams only what follows. A sampled request that comes without a seed gets
one here, before its first send, so that it too can go on.

Poison. A worker that dies holding a request before that worker made a
token of it (its engine died: WorkerError 'died'; its process or node
went) may have been killed by the request. Such a request is sent on once;
when a second worker dies the same way under it, it is failed to its
client ('poisoned_request', a 500), logged at WARNING, and never sent to a
third worker: one hostile request cannot take the cluster down in turn.

Budget. A lost worker costs the request one of `max_retries` re-sends; the
first goes at once, later ones after a doubling backoff. A worker that
refuses the request outright because its engine is dead (Serve keeps
routing to it until its failing health checks get it replaced), or because
it is full when the client already has part of the reply, costs no re-send:
the request waits with the same backoff, for at most `refused_timeout_s`.
A request a worker hands back unrun ('moved': a newer worker has room,
rebalance.py) goes on at once and costs nothing.
When the budget or that time is spent, or no worker is left, the stream
raises WorkerLost and the client gets the front's 'unavailable' answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import sys
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from shoal.proto.messages import GenerateDelta, GenerateRequest, WorkerError, WorkerInfo, WorkerLoad
from shoal.router.observability import tracing
from shoal.router.routing.pool import WorkerPool

logger = logging.getLogger(__name__)


class WorkerLost(Exception):
    """The worker serving a request is gone. In-process pools (and test
    doubles) raise it; the failover pool raises it when it gives up.
    held=False: no worker ever took the request (none was left to send it
    to), so no worker died under it."""

    def __init__(self, message: str = "", held: bool = True):
        super().__init__(message)
        self.held = held


class _Refused(Exception):
    """A worker sent a WorkerError the failover pool acts on."""

    def __init__(self, error: WorkerError):
        super().__init__(error.message)
        self.error = error


def _lost_errors() -> tuple[type[BaseException], ...]:
    """What a lost worker raises: WorkerLost, and Ray's actor errors where
    Ray is loaded (without Ray none can be raised)."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    return (WorkerLost,) if ray_exceptions is None else (WorkerLost, ray_exceptions.RayActorError)


def with_seed(request: GenerateRequest) -> GenerateRequest:
    """A sampled request without a seed gets one, so that its draws can go
    on elsewhere; any other request is returned as it is."""
    params = request.params
    if params.greedy or params.seed is not None:
        return request
    return dataclasses.replace(request, params=dataclasses.replace(params, seed=random.getrandbits(63)))


class FailoverPool:
    """A worker pool whose streams survive the loss of their worker."""

    # A request on this many workers when they died, before its first token
    # from each, is failed to its client ('poisoned_request'), never sent on.
    max_deaths = 2

    def __init__(
        self,
        pool: WorkerPool,
        max_retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        refused_timeout_s: float = 60.0,
    ):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.pool = pool
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.refused_timeout_s = refused_timeout_s
        self.num_failovers = 0  # requests sent again after a lost worker, since start
        self.num_poisoned = 0  # requests refused after killing max_deaths workers

    async def info(self) -> WorkerInfo:
        return await self.pool.info()

    async def stats(self) -> list[WorkerLoad | BaseException]:
        return await self.pool.stats()

    async def broadcast(self, method: str, *args) -> list:
        return await self.pool.broadcast(method, *args)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta | WorkerError, None]:
        request = with_seed(request)
        lost = _lost_errors()
        streamed: list[int] = []  # output token ids the client has, across attempts
        num_chars = 0  # and the characters of their text it has
        retries = failures_in_row = 0
        refused_since: float | None = None
        attempt = request
        worker = "unknown"  # the worker the latest delta came from
        deaths = 0  # workers that died holding the request before it had a token from them
        for n in itertools.count(1):
            got_delta = finished = False
            try:
                async with aclosing(self.pool.generate(attempt)) as stream:
                    async for msg in stream:
                        if isinstance(msg, WorkerError):
                            if msg.kind in ("unavailable", "moved", "died") or (msg.kind == "full" and streamed):
                                raise _Refused(msg)
                            yield msg  # refused as asked (invalid, failed, or full before the client has any)
                            return
                        got_delta = True
                        if msg.load is not None:
                            worker = msg.load.worker
                        streamed += msg.token_ids
                        num_chars += len(msg.text)
                        finished = finished or msg.finished is not None
                        yield msg
                if not finished:
                    raise WorkerLost("the worker's stream ended before the request finished")
                return
            except (_Refused, *lost) as e:  # type: ignore[misc]  # mypy reads no starred tuple here
                if finished:  # the stream broke after the last delta: nothing is missing
                    return
                failures_in_row = 1 if got_delta else failures_in_row + 1
                now = time.monotonic()
                refused = isinstance(e, _Refused) and e.error.kind != "died"
                if refused and e.error.kind == "moved":  # handed back for a newer worker: free, at once
                    failures_in_row = 0
                elif refused and not got_delta:  # not taken: costs no re-send
                    refused_since = refused_since or now
                    if now - refused_since > self.refused_timeout_s:
                        raise WorkerLost(
                            f"no worker took the request in {self.refused_timeout_s:g} s: {e.error.message}"
                        ) from e
                else:
                    refused_since = None
                    if not got_delta and getattr(e, "held", True):
                        # The worker died holding it before it made a token: the
                        # request may be what killed it. Once more elsewhere, never a third.
                        deaths += 1
                        if deaths >= self.max_deaths:
                            self.num_poisoned += 1
                            logger.warning(
                                "%s: %d workers died holding it before its first token from them "
                                "(last: %s); refused as a poisoned request, not sent to another",
                                request.log_name,
                                deaths,
                                _describe(e),
                            )
                            yield WorkerError(
                                "internal",
                                f"request {request.request_id} was on {deaths} workers "
                                "when they died; it is not sent to another",
                                code="poisoned_request",
                            )
                            return
                    retries += 1
                    if retries > self.max_retries:
                        raise WorkerLost(
                            f"{request.log_name}: worker lost {retries} times; the retry budget is {self.max_retries}"
                        ) from e
                    self.num_failovers += 1
                    tracing.failed_over(request.trace_context, worker, len(streamed), _describe(e))
                    logger.warning(
                        "%s: worker lost after %d output tokens (%s); sending it on (retry %d of %d)",
                        request.log_name,
                        len(streamed),
                        _describe(e),
                        retries,
                        self.max_retries,
                    )
            if failures_in_row > 1:
                await asyncio.sleep(min(self.backoff_s * 2 ** (failures_in_row - 2), self.max_backoff_s))
            attempt = dataclasses.replace(
                request,
                request_id=f"{request.request_id}-{n}",  # a new id: the lost one may linger
                prompt_token_ids=request.prompt_token_ids + streamed,
                num_resumed_tokens=request.num_resumed_tokens + len(streamed),
                num_resumed_chars=request.num_resumed_chars + num_chars,
                parent_request_id=None,  # its own prompt now; pinned to its group it could meet the lost worker
            )


def _describe(e: BaseException) -> str:
    if isinstance(e, _Refused):
        return f"{e.error.kind}: {e.error.message}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
