"""/health is what a load balancer needs: 200 while this router can route to
a worker, so one worker restarting does not take every router out of its
Service; /health?all=1 keeps the all-workers answer for tests and operators."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import grpc_server, http_client, make_frontend

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.load_snapshot import LoadSnapshot


class Gone:
    """A worker the pool cannot reach: its stats come back as the error, as
    a Serve broadcast with return_exceptions=True gives a dead replica's."""

    name = "gone"

    def stats(self):
        return ConnectionError("replica died")


def test_health_answers_for_this_router_and_all_for_every_worker(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_workers=2)
        fe.load_snapshot.max_age_s = 0  # each answer reads the workers as they are now
        workers = list(fe.pool.workers)
        out = {}
        async with http_client(fe) as c:

            async def both(name):
                out[name] = [(r.status_code, r.json()) for r in (await c.get("/health"), await c.get("/health?all=1"))]

            await both("all up")
            fe.pool.workers[1] = Gone()
            await both("one gone")
            fe.pool.workers[0] = Gone()
            await both("none")
            fe.pool.workers[:] = workers
            await both("back")
            await fe.drain(1.0)
            await both("draining")
        return out

    out = asyncio.run(main())
    codes = {k: [c for c, _ in v] for k, v in out.items()}
    assert codes == {
        "all up": [200, 200],
        "one gone": [200, 503],
        "none": [503, 503],
        "back": [200, 200],
        "draining": [503, 503],
    }
    assert out["one gone"][0][1] == {"status": "ok", "workers": 1, "num_workers": 2}
    assert out["one gone"][1][1]["status"] == "not ready"
    assert out["draining"][0][1]["status"] == "draining"


class Clock:
    """A clock that moves only when the test says: the snapshot's age is then exact on any machine."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_health_and_metrics_share_one_broadcast_per_half_second(tiny_model):
    import grpc

    async def main():
        fe = make_frontend(tiny_model, num_workers=2, api_key="sekret")
        clock = fe.load_snapshot.clock = Clock()
        broadcasts = []
        stats = fe.pool.stats

        async def counted():
            broadcasts.append(clock.now)
            return await stats()

        fe.pool.stats = counted
        auth = {"Authorization": "Bearer sekret"}
        async with http_client(fe) as c:
            flood = await asyncio.gather(*(c.get("/health") for _ in range(50)))
            others = [await c.get("/metrics"), await c.get("/api/status", headers=auth)]
            async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
                load = await shoal_pb2_grpc.ShoalStub(ch).GetLoad(
                    pb.GetLoadRequest(), metadata=(("authorization", "Bearer sekret"),)
                )
                probe = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            within = len(broadcasts)
            clock.now += LoadSnapshot.MAX_AGE_S + 0.1  # older than 0.5 s: the next caller reads again
            later = await asyncio.gather(*(c.get("/health") for _ in range(50)))
        return flood, others, load, probe, within, broadcasts, later

    flood, others, load, probe, within, broadcasts, later = asyncio.run(main())
    assert all(r.status_code == 200 and r.json()["workers"] == 2 for r in flood + later)
    assert [r.status_code for r in others] == [200, 200] and len(others[1].json()["workers"]) == 2
    assert len(load.workers) == 2 and probe.status == health_pb2.HealthCheckResponse.SERVING
    # 50 probes and a scrape (open to anyone): one broadcast; the status page and GetLoad
    # (behind the key) read the workers as they are now, one each.
    assert within == 3
    assert len(broadcasts) == 4


def test_snapshot_reads_once_for_callers_that_wait_together_and_a_failed_read_is_not_kept():
    async def main():
        gate, reads, outcomes = asyncio.Event(), [], iter([ConnectionError("raylet"), ["a"], ["b"]])

        async def read():
            reads.append(1)
            await gate.wait()
            got = next(outcomes)
            if isinstance(got, BaseException):
                raise got
            return got

        snap = LoadSnapshot(read, clock=Clock())
        waiting = [asyncio.ensure_future(snap.get()) for _ in range(50)]
        for _ in range(5):  # every caller reaches the read in flight (no time passes)
            await asyncio.sleep(0)
        waiting[0].cancel()  # one caller goes away: the others' read goes on
        await asyncio.sleep(0)
        gate.set()
        failed = await asyncio.gather(*waiting, return_exceptions=True)
        after_failure = await snap.get()  # nothing was kept: read again
        cached = await snap.get()
        return len(reads), failed, after_failure, cached

    n, failed, after_failure, cached = asyncio.run(main())
    assert isinstance(failed[0], asyncio.CancelledError)
    assert all(isinstance(f, ConnectionError) for f in failed[1:])
    assert after_failure == ["a"] and cached == ["a"] and n == 2
