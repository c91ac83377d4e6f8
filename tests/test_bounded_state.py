"""Nothing grows without bound: every dict keyed by a request id, on the
router and on the workers, is empty again once its requests are gone,
whichever way they went (finished, refused, cancelled by the client before
or after its first token, failed over from a lost worker); the status
page's TTFT window stays bounded; a worker that leaves takes its metric
series with it.

The mixed run drives 10,000 requests through the router's own stack
(Frontend, FailoverPool, ServeWorkerPool with its delta streams) to real
Workers whose engines run the simulated model (the real scheduler, block
manager and detokenizer; a stand-in forward of ~0.1 ms), behind a stand-in
for Serve's handle that routes and reserves as the request router does."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from contextlib import aclosing

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.proto.messages import RequestFinished, Riding
from shoal.router.fronts.frontend import Frontend, ModelInfo, ServingError
from shoal.router.fronts.prompt import Prompt
from shoal.router.observability import metrics as metrics_mod
from shoal.router.observability.metrics import RouterMetrics
from shoal.router.routing import rebalance, replica_stats
from shoal.router.routing.failover import FailoverPool, WorkerLost
from shoal.router.routing.replica_stats import ReplicaStats
from shoal.router.routing.worker_pool import ServeWorkerPool
from shoal.workers import EngineArgs, SamplingParams, delta_outbox
from shoal.workers.model_executor.runner.simulated_runner import StepCostModel
from shoal.workers.worker import Worker

FAST = StepCostModel(overhead_s=1e-4, prefill_s_per_token=1e-7, decode_s_per_seq=1e-6, decode_s_per_context_token=0.0)
NUM_REQUESTS = 10_000
WAVE = 100  # requests in flight together
KILL_EVERY = 10  # waves: a worker dies mid-wave, and Serve replaces it


# ---- units ---------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _finished(worker: str, reason: str = "length") -> RequestFinished:
    f = RequestFinished(reason, None, worker, 5, 0, 3, 0.01)
    f.time_to_first_token_s, f.total_s = 0.02, 0.05
    return f


def _series_workers(m: RouterMetrics) -> set[str]:
    return {
        s.labels["worker"]
        for fam in text_string_to_metric_families(m.render([]).decode())
        for s in fam.samples
        if "worker" in s.labels
    }


def test_ttft_window_is_pruned_on_every_insert_and_capped(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics_mod.time, "monotonic", clock)
    m = RouterMetrics("m", 1024)
    for i in range(20_000):  # 100 first tokens a second for 200 s, and nobody reads the page
        clock.now += 0.01
        m.first_token(0.001 * (i % 50))
    assert len(m._firsts) <= m.WINDOW_S * 100 + 1
    assert clock.now - m._firsts[0][0] <= m.WINDOW_S
    for _ in range(3 * m.MAX_FIRSTS):  # a burst far past the cap within one window
        m.first_token(0.5)
    assert len(m._firsts) == m.MAX_FIRSTS
    assert m.recent_ttft() == (0.5, 0.5)
    clock.now += m.WINDOW_S + 1
    m.first_token(0.25)
    assert len(m._firsts) == 1 and m.recent_ttft() == (0.25, 0.25)


def test_a_departed_workers_series_go_and_late_ones_go_after_a_while(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics_mod.time, "monotonic", clock)
    stats = ReplicaStats()
    monkeypatch.setattr(replica_stats, "REGISTRY", stats)
    m = RouterMetrics("m", 1024)
    for w in ("w-a", "w-b"):
        stats.get(w)
        m.finished(_finished(w), [0.01, 0.01])
        m.finished(_finished(w, "stop"), [])
    assert _series_workers(m) == {"w-a", "w-b"}
    stats.retain(["w-b"])  # Serve's long poll: w-a left
    assert _series_workers(m) == {"w-b"}
    # A request that finishes on w-a after it left (it was draining) brings its series back, for LATE_S.
    m.finished(_finished("w-a"), [])
    assert _series_workers(m) == {"w-a", "w-b"}
    stats.observe_worker_load(type("L", (), {"worker": "w-a"})())  # a late delta's load: ignored
    assert "w-a" not in stats.replicas
    clock.now += m.LATE_S + 1
    assert _series_workers(m) == {"w-b"}  # swept at the next scrape
    # The registry holds its listeners weakly: a router's metrics gone is a listener gone.
    del m
    stats.get("w-c")
    stats.drop("w-c")
    assert stats._on_departure == []


@pytest.mark.parametrize("policy", ["kv", "pow2"])
def test_the_request_router_removes_the_series_of_replicas_that_left(monkeypatch, policy):
    from types import SimpleNamespace

    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.request_router import RequestRouter

    from shoal.router.routing.request_router import router_class

    for base in (RequestRouter, PowerOfTwoChoicesRequestRouter):  # Serve's own bookkeeping is not under test
        monkeypatch.setattr(base, "update_replicas", lambda self, replicas: None)
        monkeypatch.setattr(base, "on_replica_actor_died", lambda self, replica_id: None)
    stats = ReplicaStats()
    monkeypatch.setattr(replica_stats, "REGISTRY", stats)
    m = RouterMetrics("m", 1024)
    for w in ("w-a", "w-b", "w-c"):
        stats.observe_load(w, 10, 10, 0, 0)  # as the deltas' loads make them known
        m.finished(_finished(w), [0.01])
    cls = router_class(policy)
    router = cls.__new__(cls)  # as Serve calls it, without its state

    def replica(name):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})

    cls.update_replicas(router, [replica("w-b"), replica("w-c")])  # Serve's long poll: w-a was stopped
    assert _series_workers(m) == {"w-b", "w-c"} and set(stats.replicas) == {"w-b", "w-c"}
    cls.on_replica_actor_died(router, replica("w-b").replica_id)
    assert _series_workers(m) == {"w-c"} and set(stats.replicas) == {"w-c"}


def test_a_reservation_made_after_its_stream_ended_is_not_kept():
    stats = ReplicaStats()
    stats.reserve("a", "w", 2, [1, 2])
    stats.done("a")
    # Serve still routing when the client went away: its stream ends, then the router reserves it.
    stats.done("b")
    stats.reserve("b", "w", 2, [3, 4])
    assert stats.num_request_entries() == 0 and stats.get("w").in_flight == 0
    assert stats.get("w").sent_blocks == 0
    for i in range(3 * replica_stats.MAX_REMEMBERED):  # never reserved (Serve's pow2 router reserves nothing)
        stats.done(f"x{i}")
    assert len(stats._ended) == replica_stats.MAX_REMEMBERED


def test_the_rebalancer_forgets_workers_long_gone():
    r = rebalance.Rebalancer(handle=None)
    stats = ReplicaStats()
    for i in range(3 * rebalance.MAX_SEEN):  # workers replaced one after another
        stats.observe_load(f"w{i}", 10, 10, 0, 0)
        r.plan(stats)
        stats.drop(f"w{i}")
    stats.observe_load("live", 10, 10, 0, 0)
    r.plan(stats)
    assert len(r._seen) <= rebalance.MAX_SEEN + 1 and "live" in r._seen


# ---- 10,000 mixed requests ---------------------------------------------------


def _retrieve(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()


class _Call:
    """One Serve streaming call: an async iterator with cancel() (which
    aborts the call at the worker, as Serve's does); it raises WorkerLost,
    as Ray raises RayActorError, once its worker is dead."""

    def __init__(self, handle, index: int, agen, routed=None):
        self.handle, self.index, self.agen = handle, index, agen
        self._next: asyncio.Future | None = None
        self.routed = routed  # Serve's routing, when it is still under way at cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            if self.index in self.handle.dead:
                self.cancel()
                raise WorkerLost(f"worker {self.index} died")
            if self._next is None:
                self._next = asyncio.ensure_future(self.agen.__anext__())
                self._next.add_done_callback(_retrieve)
            done, _ = await asyncio.wait({self._next}, timeout=self.handle.poll_s)
            if done:
                next_, self._next = self._next, None
                return next_.result()

    def cancel(self):
        if self._next is not None and not self._next.done():
            self._next.cancel()  # thrown into the worker's generator, which ends
        else:
            asyncio.get_running_loop().create_task(self.agen.aclose()).add_done_callback(_retrieve)
        if self.routed is not None:
            self.routed, routed = None, self.routed
            routed()


class ChurningHandle:
    """Serve's handle to the workers, in-process: `generate` goes to the live
    worker sent the fewest, reserved in replica_stats.REGISTRY as the
    request router does (a moment later, as Serve routes in a task of its
    own); `subscribe` to the worker it names. A worker marked to die
    after n more tokens dies at that point, like a killed process: every
    stream on it raises WorkerLost."""

    poll_s = 0.02

    def __init__(self, make_worker, n: int):
        self.make_worker = make_worker
        self.sent_events: dict[str, asyncio.Event] = {}  # request id -> set once it is sent (a client's hook)
        self.ws = [make_worker() for _ in range(n)]
        self.dead: set[int] = set()
        self.sent = [0] * n
        self.tokens = [0] * n
        self.die_at: dict[int, int] = {}
        self.replaced: set[int] = set()
        self.riding = 0

    def live(self) -> list[int]:
        return [i for i in range(len(self.ws)) if i not in self.dead]

    def kill_after(self, i: int, n: int) -> None:
        self.die_at[i] = self.tokens[i] + n

    def replace_dead(self) -> None:
        """Serve's long poll tells the router which replicas are left, and a
        new replica takes the dead one's place."""
        for i in self.dead - self.replaced:
            self.replaced.add(i)
            self.ws.append(self.make_worker())
            self.sent.append(0)
            self.tokens.append(0)
        replica_stats.REGISTRY.retain([self.ws[i].name for i in self.live()])

    def options(self, method_name: str, **_):
        handle = self

        class Method:
            def remote(self, arg):
                if method_name == "subscribe":
                    i = next(i for i, w in enumerate(handle.ws) if w.name == arg.replica)
                    return _Call(handle, i, handle._watch(i, handle.ws[i].subscribe(arg)))
                i = min(handle.live(), key=handle.sent.__getitem__)
                handle.sent[i] += 1
                reserve = functools.partial(
                    replica_stats.REGISTRY.reserve, arg.request_id, handle.ws[i].name, 1, arg.block_hashes or ()
                )
                agen = handle._watch(i, handle.ws[i].generate(arg))
                if (sent := handle.sent_events.pop(arg.request_id, None)) is not None:
                    sent.set()  # its client hangs up now, while Serve is still routing it (it reserves after)
                    return _Call(handle, i, agen, routed=reserve)
                asyncio.get_running_loop().call_soon(reserve)  # Serve's routing task, a moment later
                return _Call(handle, i, agen)

        return Method()

    async def _watch(self, i: int, agen):
        async with aclosing(agen):
            async for msg in agen:
                if isinstance(msg, list):  # a delta stream's batch
                    n = sum(len(d.token_ids) for _, d in msg)
                else:
                    n = len(getattr(msg, "token_ids", ()))
                    self.riding += isinstance(msg, Riding)
                if i in self.die_at and self.tokens[i] + n > self.die_at[i]:
                    self.dead.add(i)
                if i in self.dead:
                    raise WorkerLost(f"worker {i} died")
                self.tokens[i] += n
                yield msg


async def _one(fe: Frontend, handle: ChurningHandle, ids: list[int], kind: int, n: int) -> str:
    """One client: what became of its request."""
    max_tokens = 1020 if kind == 9 else n  # 9: the worker refuses it (past max_model_len)
    params = SamplingParams(
        temperature=0 if kind % 2 else 0.7, max_tokens=max_tokens, ignore_eos=True, stop=["zz"] if kind == 3 else None
    )
    rid = fe.new_request_id("cmpl")
    if kind == 6:  # the client hangs up once its request is sent, before its first token
        sent = handle.sent_events[rid] = asyncio.Event()
        task = asyncio.ensure_future(_stream(fe, ids, params, rid, kind))
        await sent.wait()
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"
    if kind == 8:  # refused by the router's own checks
        try:
            await fe.prepare(Prompt(text="Hello, world"), {"max_tokens": 4, "temperature": -1.0})
        except ServingError as e:
            return f"router-{e.kind}"
        return "accepted?"
    return await _stream(fe, ids, params, rid, kind)


async def _stream(fe: Frontend, ids: list[int], params: SamplingParams, rid: str, kind: int) -> str:
    got = 0
    try:
        async with aclosing(fe.generate(ids, params, rid)) as stream:
            async for msg in stream:
                got += len(msg.token_ids)
                if kind == 7 and got:  # the client hangs up after its first token
                    return "hung-up"
                if msg.finished is not None:
                    return "finished"
    except ServingError as e:
        return f"worker-{e.kind}"
    return "no-finish?"


async def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def _engine_entries(w: Worker) -> dict[str, int]:
    e = w.engine
    bm = e.engine.block_manager
    return {
        "queues": len(e._queues),
        "pending": len(e._pending),
        "requests": len(e.engine.requests),
        "waiting": e.engine.scheduler.num_waiting,
        "running": e.engine.scheduler.num_running,
        "blocks_held": bm.num_total_blocks - bm.num_free_blocks,
        "outboxes": len(w._outboxes),
    }


def test_10000_mixed_requests_leave_no_request_keyed_entry_behind(tiny_model, tmp_path, monkeypatch):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"cost_model": FAST.to_dict(), "cases": []}))
    monkeypatch.setattr(rebalance, "start", lambda handle: None)  # the handle has no broadcast
    monkeypatch.setattr(delta_outbox, "IDLE_S", 0.1)  # delta streams end soon after the run
    monkeypatch.setattr(replica_stats, "REGISTRY", ReplicaStats())
    args = EngineArgs(
        model=tiny_model, load_format="simulated", simulated_cost_model=str(cost), num_kv_blocks=512, max_model_len=1024
    )

    async def main():
        handle = ChurningHandle(lambda: Worker(args, max_waiting=10_000), 3)
        w0 = handle.ws[0]
        pool = FailoverPool(ServeWorkerPool(handle, "router-bounded"), max_retries=3, backoff_s=0.001)
        fe = Frontend(pool, w0.engine.engine.tokenizer, ModelInfo.from_worker_info(w0.info(), 3))
        prompts = [
            w0.engine.engine.tokenize(f"Numbers: {i} {i + 1} {i + 2} and the quick brown fox") for i in range(50)
        ]
        outcomes: dict[str, int] = {}
        t0 = time.perf_counter()
        for wave in range(NUM_REQUESTS // WAVE):
            if wave % KILL_EVERY == KILL_EVERY // 2:  # a worker dies with this wave's requests on it
                handle.kill_after(handle.live()[wave % len(handle.live())], WAVE // 2)
            tasks = []
            for j in range(WAVE):
                i = wave * WAVE + j
                kind = i % 10
                tasks.append(asyncio.ensure_future(_one(fe, handle, prompts[i % 50], kind, 2 + i % 5)))
            for r in await asyncio.gather(*tasks):
                outcomes[r] = outcomes.get(r, 0) + 1
            handle.replace_dead()
        elapsed = time.perf_counter() - t0

        mux, stats = pool.pool.mux, replica_stats.REGISTRY
        # The delta streams end once idle; their readers with them.
        settled = await _until(
            lambda: (
                not mux._readers
                and all(not w._outboxes for w in handle.ws)
                and all(not any(_engine_entries(w).values()) for w in handle.ws)
            )
        )
        live = {handle.ws[i].name for i in handle.live()}
        dead = {w.name for w in handle.ws} - live
        result = dict(
            outcomes=outcomes,
            elapsed=elapsed,
            settled=settled,
            failovers=pool.num_failovers,
            riding=handle.riding,
            dead=dead,
            live=live,
            in_flight=fe.num_in_flight,
            mux=(mux.num_request_entries, len(mux._retry_at)),
            firsts=list(fe.metrics._firsts),
            stats=(
                stats.num_request_entries(),
                sum(f.in_flight for f in stats.replicas.values()),
                set(stats.replicas),
                len(stats._ended),
            ),
            engines={w.name: _engine_entries(w) for w in handle.ws},
            series=_series_workers(fe.metrics),
        )
        for w in handle.ws:
            await w.engine.shutdown()
        return result

    r = asyncio.run(main())
    print(f"{NUM_REQUESTS} requests in {r['elapsed']:.1f} s: {r['outcomes']}, {r['failovers']} failovers")
    o = r["outcomes"]
    assert sum(o.values()) == NUM_REQUESTS
    assert o["router-invalid"] == o["worker-invalid"] == NUM_REQUESTS // 10
    assert o["cancelled"] == o["hung-up"] == NUM_REQUESTS // 10
    assert o["finished"] == NUM_REQUESTS * 6 // 10  # every other request finished, failed over or not
    assert len(r["dead"]) == NUM_REQUESTS // WAVE // KILL_EVERY and r["failovers"] >= len(r["dead"])
    assert r["riding"] > NUM_REQUESTS // 2  # most requests rode their router's delta stream
    # Router: nothing left keyed by a request; the registry knows only the live workers.
    assert r["settled"] and r["in_flight"] == 0 and r["mux"][0] == 0 and r["mux"][1] <= len(r["dead"])
    entries, in_flight, replicas, ended = r["stats"]
    assert entries == 0 and in_flight == 0 and replicas == r["live"] and ended <= replica_stats.MAX_REMEMBERED
    firsts = r["firsts"]  # the status page's TTFT window: its last WINDOW_S at most, MAX_FIRSTS at most
    assert 0 < len(firsts) <= RouterMetrics.MAX_FIRSTS and firsts[-1][0] - firsts[0][0] <= RouterMetrics.WINDOW_S
    # Workers, the dead ones included (their streams were cut): no request, no block, no outbox.
    assert all(not any(e.values()) for e in r["engines"].values()), r["engines"]
    # The dead workers' metric series went with them.
    assert r["series"] <= r["live"] and r["series"]
