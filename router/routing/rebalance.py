"""When a new worker is ready, requests still waiting on deeper queues move
to it, rather than waiting behind the old backlog.

A worker added by the autoscaler (or one replacing a lost worker) starts
empty while the others may hold long queues: the router only routes new
requests, so without this the new worker would take only those while the
old queues drain at their old pace. The router process watches its
routing figures (replica_stats.REGISTRY): a worker that reports for the
first time is new. The router then asks every worker (one broadcast) to
keep its share of the waiting requests, the mean over all workers rounded
up, and hand back the newest of the rest that never ran
(Worker.release_waiting). Their streams end with WorkerError 'moved', and
the failover pool sends each on at once, at no cost to its retries; the
request router sends it where it is cheapest, which is now the new worker.

Shares rather than counts make the call safe to repeat: with several
router replicas, each asks for the same shares, and a worker already at
its share hands back nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

from shoal.router.routing import replica_stats

logger = logging.getLogger(__name__)
# Workers remembered as seen; past it the oldest no longer in the figures go.
MAX_SEEN = 1024


def shares(waiting: dict[str, int], new: Iterable[str]) -> dict[str, int]:
    """How many waiting requests each worker that is not `new` keeps: the
    mean over all of them, rounded up; only workers holding more are listed."""
    new = set(new)
    if not new or not waiting:
        return {}
    keep = math.ceil(sum(waiting.values()) / len(waiting))
    return {w: keep for w, n in waiting.items() if w not in new and n > keep}


class Rebalancer:
    """Watches the routing figures; when a worker is new, asks the deep
    queues to hand back their share (Worker.release_waiting, broadcast)."""

    PERIOD_S = 0.2

    def __init__(self, handle):
        self._handle = handle
        # Every worker seen report, gone or not (up to MAX_SEEN): a worker
        # draining away may show up again in the figures, and is not new.
        self._seen: dict[str, None] = {}

    def plan(self, stats: replica_stats.ReplicaStats) -> dict[str, int]:
        """The shares to ask for now (empty: none), given the figures."""
        ready = {name: f for name, f in list(stats.replicas.items()) if f.total_blocks}  # reported once at least
        new = ready.keys() - self._seen.keys()
        self._seen.update(dict.fromkeys(new))
        if len(self._seen) > MAX_SEEN:  # oldest first; those still reporting stay
            gone = [w for w in self._seen if w not in stats.replicas][: len(self._seen) - MAX_SEEN]
            for w in gone:
                del self._seen[w]
        return shares({name: f.waiting + len(f.sent) for name, f in ready.items()}, new)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.PERIOD_S)
            keep = self.plan(replica_stats.REGISTRY)
            if not keep:
                continue
            try:
                moved = await self._handle.broadcast("release_waiting", keep).results_async(
                    timeout_s=5.0, return_exceptions=True
                )
                logger.info(
                    "a new worker is ready: asked %s to keep %s waiting; handed back %s",
                    sorted(keep),
                    sorted(set(keep.values())),
                    moved,
                )
            except Exception:
                logger.exception("asking the workers to hand back waiting requests failed")


def start(handle) -> asyncio.Task | None:
    """Run a Rebalancer over `handle` (the workers' Serve handle) on this
    event loop; None outside one."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.create_task(Rebalancer(handle).run(), name="shoal-rebalance")
