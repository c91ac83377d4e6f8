"""What the front needs of its workers. ServeWorkerPool (a Serve handle),
LocalWorkerPool (Worker objects in this process) and FailoverPool (either,
with streams that survive a lost worker) all meet it."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from shoal.proto.messages import GenerateDelta, GenerateRequest, WorkerError, WorkerInfo, WorkerLoad


@runtime_checkable
class WorkerPool(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateDelta | WorkerError, None]:
        """One request's deltas (an async generator); a refusal or failure
        comes as a WorkerError, a lost worker raises."""
        ...

    async def info(self) -> WorkerInfo:
        """The model the workers serve (one answer for all of them)."""
        ...

    async def stats(self) -> list[WorkerLoad | BaseException]:
        """Each worker's load, or the error that asking it raised."""
        ...

    async def broadcast(self, method: str, *args) -> list:
        """Call a Worker method on every worker (a control-plane call: LoRA
        loads); each one's result, or the error that calling it raised."""
        ...
