"""How the router reaches its workers: a Ray Serve handle in the cluster, or
Worker objects in this process (tests, benchmarks of the router itself)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from shoal.workers.messages import GenerateDelta, GenerateRequest, WorkerError, WorkerInfo, WorkerLoad


class ServeWorkerPool:
    """The worker deployment behind a Serve DeploymentHandle. Serve's default
    request router sends each request to the replica with fewer requests in
    flight (power of two choices); routing on free KV blocks comes later."""

    def __init__(self, handle):
        self._stream = handle.options(method_name="generate", stream=True, _by_reference=False)
        self._handle = handle

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta | WorkerError]:
        gen = self._stream.remote(request)
        done = False
        try:
            async for msg in gen:
                yield msg
            done = True
        finally:
            if not done:  # the client went away: abort in the engine, free its blocks
                gen.cancel()

    async def info(self) -> WorkerInfo:
        return await self._handle.options(method_name="info").remote()

    async def stats(self) -> list[WorkerLoad | BaseException]:
        """Every live worker's stats, read now (a control-plane broadcast)."""
        resp = self._handle.broadcast("stats")
        return await resp.results_async(timeout_s=5.0, return_exceptions=True)


class LocalWorkerPool:
    """Workers in this process; each request goes to the one with the fewest
    requests in flight."""

    def __init__(self, workers: list):
        self.workers = workers
        self._outstanding = [0] * len(workers)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta | WorkerError]:
        i = min(range(len(self.workers)), key=self._outstanding.__getitem__)
        self._outstanding[i] += 1
        try:
            async with aclosing(self.workers[i].generate(request)) as stream:
                async for msg in stream:
                    yield msg
        finally:
            self._outstanding[i] -= 1

    async def info(self) -> WorkerInfo:
        return self.workers[0].info()

    async def stats(self) -> list[WorkerLoad | BaseException]:
        await asyncio.sleep(0)
        return [w.stats() for w in self.workers]
