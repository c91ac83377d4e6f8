"""Several engine requests' delta streams as one (the choices of n, the prompts
of one completions request), each delta tagged with its stream's index.

Bounded: the queue holds as many items as there are streams, so a client that reads
slowly stops the pumps, and each stream's own deltas then wait (merged, and
up to --max-stream-buffer-tokens) in its buffer at the router
(routing/stream_buffer.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from shoal.proto.messages import GenerateDelta


async def merge_streams(
    streams: list[AsyncGenerator[GenerateDelta, None]], firsts: list[GenerateDelta] | None = None
) -> AsyncGenerator[tuple[int, GenerateDelta], None]:
    """(index, delta) as they come. firsts: each stream's first delta, taken
    already (the HTTP front waits for them to answer a refusal with its own
    status). The first error ends them all; closing this closes every stream,
    which aborts its engine request."""
    if firsts is not None:
        for i, f in enumerate(firsts):
            yield i, f
    live = [i for i in range(len(streams)) if firsts is None or firsts[i].finished is None]
    if len(live) == 1:  # no task and no queue in the common case
        async with aclosing(streams[live[0]]) as stream:
            async for msg in stream:
                yield live[0], msg
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))  # bounded: a slow client slows the pumps

    async def pump(i: int) -> None:
        try:
            async with aclosing(streams[i]) as stream:
                async for msg in stream:
                    await queue.put((i, msg))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in live]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
