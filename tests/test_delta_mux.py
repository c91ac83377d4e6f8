"""The router's one delta stream per worker (router/routing/delta_mux.py,
workers/delta_outbox.py), in-process: real Workers on the tiny model behind
a stand-in for Serve's handle that calls their methods as Serve would (a
generate or subscribe call is an async stream with cancel()). The requests'
tokens and text equal their own streams', the deltas of a step travel as
one batch, and a worker lost under riding requests is failed over."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from engine_hold import EngineHold, until

from shoal.proto.messages import Riding, Subscribe
from shoal.router.routing import rebalance, replica_stats
from shoal.router.routing.failover import FailoverPool, WorkerLost
from shoal.router.routing.worker_pool import ServeWorkerPool
from shoal.workers import delta_outbox
from tests.test_failover import PROMPTS, Result, all_free, request, run, same, workers


class _Call:
    """One Serve streaming call: an async iterator with cancel(); it raises
    WorkerLost (as Ray raises RayActorError) once its worker is dead."""

    def __init__(self, handle, index: int, agen):
        self.handle, self.index, self.agen = handle, index, agen
        self._next = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            if self.index in self.handle.dead:
                if self._next is not None:
                    self._next.cancel()
                raise WorkerLost(f"worker {self.index} died")
            if self._next is None:
                self._next = asyncio.ensure_future(self.agen.__anext__())
                # read here, or retrieved if its reader was cancelled first (its end is then nobody's)
                self._next.add_done_callback(lambda f: f.cancelled() or f.exception())
            done, _ = await asyncio.wait({self._next}, timeout=self.handle.poll_s)
            if done:
                next_, self._next = self._next, None
                return next_.result()

    def cancel(self):
        # As Serve cancels the replica's call: the generator stops where it waits (aclose() would
        # refuse a generator that is running, as it is while a __anext__ is pending).
        if self._next is not None and not self._next.done():
            self._next.cancel()
        else:
            asyncio.get_running_loop().create_task(self.agen.aclose())


class StandInHandle:
    """What ServeWorkerPool needs of a DeploymentHandle: `generate` goes to
    the live worker with the fewest requests sent, `subscribe` to the one it
    names (a dead one never answers, as Serve would keep it pending)."""

    poll_s = 0.05

    def __init__(self, ws):
        self.ws, self.dead = ws, set()
        self.sent = [0] * len(ws)
        self.riding = 0
        self.subscribed: list[str] = []

    def options(self, method_name: str, **_):
        handle = self

        class Method:
            def remote(self, arg):
                if method_name == "subscribe":
                    handle.subscribed.append(arg.replica)
                    i = next(i for i, w in enumerate(handle.ws) if w.name == arg.replica)
                    return _Call(handle, i, handle.ws[i].subscribe(arg))
                live = [i for i in range(len(handle.ws)) if i not in handle.dead]
                i = min(live, key=handle.sent.__getitem__)
                handle.sent[i] += 1
                return _Call(handle, i, handle._watch(handle.ws[i].generate(arg)))

        return Method()

    async def _watch(self, agen):
        async with aclosing(agen):
            async for msg in agen:
                self.riding += isinstance(msg, Riding)
                yield msg


@pytest.fixture(autouse=True)
def _no_rebalancer(monkeypatch):
    monkeypatch.setattr(rebalance, "start", lambda handle: None)
    yield
    replica_stats.REGISTRY.replicas.clear()


async def _many(pool, reqs) -> list[Result]:
    return await asyncio.gather(*(run(pool, r) for r in reqs))


def test_riding_requests_equal_their_own_streams_and_share_batches(tiny_model):
    async def main():
        async with workers(tiny_model) as ws:
            reqs = [
                request(ws, p, f"r{i}", temperature=0, max_tokens=16, ignore_eos=True) for i, p in enumerate(PROMPTS)
            ]
            refs = [await run(ws[0], r) for r in reqs]  # each on a worker's own stream, alone
            handle = StandInHandle(ws)
            pool = ServeWorkerPool(handle, "router-a")
            first = await _many(pool, [request(ws, PROMPTS[0], f"w{i}", temperature=0, max_tokens=4) for i in range(2)])
            # The first deltas opened the stream to each worker: later requests ride once it is up there.
            up = await until(lambda: all(pool.mux.router_id in w._outboxes for w in ws))
            opened = set(handle.subscribed) if up < 10 else set()
            got = await _many(
                pool,
                [request(ws, p, f"s{i}", temperature=0, max_tokens=16, ignore_eos=True) for i, p in enumerate(PROMPTS)],
            )
            return refs, got, first, opened, {w.name for w in ws}, handle.riding, pool.mux, await all_free(ws)

    refs, got, first, opened, names, riding, mux, free = asyncio.run(main())
    assert all(len(r.tokens) == 4 for r in first)
    assert opened == names  # one stream per worker, opened by the first requests' deltas
    for g, r in zip(got, refs):
        assert g.tokens == r.tokens and g.text == r.text and len(g.finished) == 1
    assert riding == len(PROMPTS)  # every later request rode its router's stream
    # 8 requests of 16 tokens: up to 128 deltas (the engine merges a request's deltas when its
    # reader lags, so fewer under load), in far fewer batches (one per worker per step).
    assert 8 <= mux.num_deltas <= 8 * 16 and mux.num_batches < mux.num_deltas / 2
    assert free


def test_a_worker_lost_under_riding_requests_fails_them_over_without_gap_or_repeat(tiny_model):
    async def main():
        async with workers(tiny_model) as ws:
            params = dict(temperature=0, max_tokens=24, ignore_eos=True)
            refs = [await run(ws[1], request(ws, p, f"ref{i}", **params)) for i, p in enumerate(PROMPTS[:4])]
            handle = StandInHandle(ws)
            pool = FailoverPool(ServeWorkerPool(handle, "router-b"), max_retries=2)
            await _many(pool, [request(ws, PROMPTS[0], f"w{i}", temperature=0, max_tokens=2) for i in range(2)])
            assert await until(lambda: all(pool.pool.mux.router_id in w._outboxes for w in ws)) < 10

            # Worker 0 holds its requests mid-stream after 6 steps: they are riding at the kill on any machine.
            steps = ws[0].engine.engine.num_steps
            hold = EngineHold(ws[0], steps=6)

            async def kill_when_riding():
                assert await until(lambda: hold.held(steps + 6) and handle.riding == 4) < 10
                handle.dead.add(0)

            killer = asyncio.create_task(kill_when_riding())
            got = await _many(pool, [request(ws, p, f"k{i}", **params) for i, p in enumerate(PROMPTS[:4])])
            await killer
            return (
                refs,
                got,
                pool.num_failovers,
                [r.finished[0].worker for r in got],
                ws[1].name,
                await all_free(ws[1:]),
            )

    refs, got, failovers, where, survivor, free = asyncio.run(main())
    for g, r in zip(got, refs):
        same(g, r)
    assert failovers >= 1 and set(where) == {survivor} and free


def test_a_subscription_declines_another_replica_and_ends_when_idle(tiny_model, monkeypatch):
    monkeypatch.setattr(delta_outbox, "IDLE_S", 0.2)

    async def main():
        async with workers(tiny_model, n=1) as ws:
            w = ws[0]
            declined = [b async for b in w.subscribe(Subscribe("r", "someone-else"))]
            sub = w.subscribe(Subscribe("r", w.name))
            hello = await sub.__anext__()
            req = request(w and ws, PROMPTS[3], "x", temperature=0, max_tokens=5, ignore_eos=True)
            req.mux = "r"
            own = [m async for m in w.generate(req)]
            batches = []
            async for b in sub:  # the request's deltas, then the end once idle
                batches.append(b)
            return declined, hello, own, batches, "r" in w._outboxes

    declined, hello, own, batches, still_open = asyncio.run(main())
    assert declined == [] and hello == []
    assert [type(m).__name__ for m in own] == ["Riding"]
    deltas = [d for b in batches for rid, d in b if rid == "x"]
    assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finished is not None
    assert not still_open
