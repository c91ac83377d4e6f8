"""/health is what a load balancer needs: 200 while this router can route to
a worker, so one worker restarting does not take every router out of its
Service; /health?all=1 keeps the all-workers answer for tests and operators."""

from __future__ import annotations

import asyncio

from serving import http_client, make_frontend


class Gone:
    """A worker the pool cannot reach: its stats come back as the error, as
    a Serve broadcast with return_exceptions=True gives a dead replica's."""

    name = "gone"

    def stats(self):
        return ConnectionError("replica died")


def test_health_answers_for_this_router_and_all_for_every_worker(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_workers=2)
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
