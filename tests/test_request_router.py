"""The request router's scoring (router/routing/policies/) over hand-made replica
figures, its registry (router/routing/replica_stats.py), the worker's exports it
feeds on, and (slow tier) prefix affinity in a served cluster."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, fields
from types import SimpleNamespace

import pytest

from shoal.proto.block_hash import chain_hashes
from shoal.proto.messages import GenerateRequest, WorkerLoad
from shoal.proto.sampling_params import SamplingParams
from shoal.router.routing import policies as routing
from shoal.router.routing import replica_stats
from shoal.router.routing.replica_stats import GRACE_S, ReplicaFigures, ReplicaStats
from shoal.workers.core.block_pool import BlockPool

BS = 16
KV = routing.get_policy("kv")


def fig(free=200, total=200, running=0, waiting=0, held=(), waiting_tokens=0) -> ReplicaFigures:
    return ReplicaFigures(free, total, running, waiting, waiting_tokens, reported_at=1.0, held=dict.fromkeys(held, 0.0))


def request(ids: list[int], max_tokens: int = 64, rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        rid or f"r{random.random()}", ids, SamplingParams(max_tokens=max_tokens), 0, None, chain_hashes(ids, BS)
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def first(figs, req) -> int:
    return KV.choose(req, figs, BS).order[0]


# ---- scoring -------------------------------------------------------------------


def test_an_emptier_replica_wins():
    req = request(prompt(160))
    # Fewer requests queued wins; then, queues equal, more free blocks.
    assert first([fig(running=2, waiting=1), fig(running=1)], req) == 1
    # A waiting request's prefill weighs more than a few running ones' decodes.
    assert first([fig(waiting=1, waiting_tokens=500), fig(running=3)], req) == 1
    assert first([fig(free=50), fig(free=150)], req) == 1
    # An unreported replica (just started) counts as empty.
    assert first([fig(running=1), ReplicaFigures()], req) == 1


def test_a_prefix_holder_wins_when_blocks_allow_and_loses_when_it_cannot_fit():
    ids = prompt(640)  # 40 blocks
    req = request(ids, max_tokens=2000)  # expected output capped: need = ceil((640 + 256) / 16) = 56 blocks
    need = routing.need_of(req, BS)
    assert (need.prompt_tokens, need.blocks, need.usable) == (640, 56, 39)
    holder = chain_hashes(ids, BS)[:30]
    # The holder is busier and fuller, yet 30 blocks of prefill saved outweigh that.
    figs = [fig(free=150, running=2), fig(free=100, running=3, held=holder)]
    order, blocks, tokens = KV.choose(req, figs, BS)
    assert order == [1, 0] and blocks == 56 - 30 and tokens == 640 - 30 * BS
    # With 20 free blocks it cannot take the 26 the request still needs: the other one wins.
    assert first([fig(free=150, running=2), fig(free=20, held=holder)], req) == 0
    # ...and where none fits, the one closest to fitting comes first.
    assert first([fig(free=10, running=2), fig(free=20, held=holder)], req) == 1
    # Blocks this process sent it since its report count against it too.
    stats = ReplicaStats()
    for name, f in (("a", fig(free=150, running=2)), ("b", fig(free=40, running=3, held=holder))):
        stats.replicas[name] = f
    assert first([stats.get("a"), stats.get("b")], req) == 1
    stats.reserve("other", "b", 20, now=time.time())
    assert first([stats.get("a"), stats.get("b")], req) == 0


def test_a_deep_queue_outweighs_a_prefix_hit():
    ids = prompt(640)
    holder = chain_hashes(ids, BS)[:20]  # 320 tokens it need not prefill there (counted twice: 640)
    # A queue of long prefills outweighs the hit; a queue of short ones (mostly hits) does not.
    assert first([fig(), fig(waiting=1, waiting_tokens=700, held=holder)], request(ids)) == 0
    assert first([fig(), fig(waiting=3, waiting_tokens=200, held=holder)], request(ids)) == 1
    # Running requests weigh by their number.
    assert first([fig(), fig(running=2, held=holder)], request(ids)) == 1
    assert first([fig(), fig(running=6, held=holder)], request(ids)) == 0


def burst(stats: ReplicaStats, names: list[str], reqs: list[GenerateRequest], reserve: bool = True) -> list[str]:
    out = []
    for req in reqs:
        order, blocks, tokens = KV.choose(req, [stats.get(n) for n in names], BS)
        out.append(names[order[0]])
        if reserve:
            stats.reserve(req.request_id, out[-1], blocks, req.block_hashes, tokens=tokens)
    return out


def test_optimistic_accounting_spreads_a_burst():
    names = ["a", "b", "c", "d"]
    ids = prompt(128)
    fresh = lambda: _stats_with({n: fig() for n in names})  # noqa: E731
    reqs = [request(ids, rid=f"q{i}") for i in range(8)]
    # Without it, every request of the burst lands on the replica that looked emptiest.
    assert set(burst(fresh(), names, reqs, reserve=False)) == {"a"}
    # With it, the identical requests spread evenly.
    chosen = burst(fresh(), names, reqs)
    assert sorted(chosen.count(n) for n in names) == [2, 2, 2, 2]
    # A burst sharing a long prefix stays on the replica that will hold it
    # (each after the first prefills only its last block there), up to the
    # point where the queue there outweighs prefilling it all elsewhere.
    long = [request(prompt(2000), rid=f"l{i}") for i in range(12)]
    assert set(burst(fresh(), names, long)) == {"a"}
    chosen = burst(fresh(), names, [request(prompt(2000), rid=f"m{i}") for i in range(60)])
    assert 2 <= len(set(chosen)) and chosen[:12] == ["a"] * 12
    # A burst of long prompts that share nothing spreads at once.
    distinct = burst(fresh(), names, [request(prompt(2000, seed=i), rid=f"d{i}") for i in range(8)])
    assert sorted(distinct.count(n) for n in names) == [2, 2, 2, 2]


def _stats_with(figs: dict[str, ReplicaFigures]) -> ReplicaStats:
    stats = ReplicaStats()
    stats.block_size = BS
    stats.replicas.update(figs)
    return stats


def test_a_fresher_report_supersedes_the_optimistic_counts():
    stats = _stats_with({"a": fig()})
    t0 = 1000.0
    for i in range(3):
        stats.reserve(f"q{i}", "a", 5, now=t0 + i * 0.01)
    f = stats.get("a")
    assert (len(f.sent), f.sent_blocks, f.in_flight) == (3, 15, 3)
    assert routing.queue_depth(f) == 3
    stats.observe_load("a", 200, 200, 0, 0, taken_at=t0 + 0.05)  # too soon to count them: they stay
    assert len(f.sent) == 3
    stats.observe_load("a", 190, 200, 0, 1, taken_at=t0 + 0.015 + GRACE_S)  # counts the first two
    assert (list(f.sent), f.sent_blocks, f.waiting) == (["q2"], 5, 1)
    stats.observe_load("a", 200, 200, 0, 0, taken_at=t0)  # older than the one held: ignored
    assert (f.free_blocks, f.waiting) == (190, 1)
    stats.ack("q2")  # its first delta came back: the worker counts it
    assert (f.sent, f.sent_blocks, f.in_flight) == ({}, 0, 3)
    for i in range(3):
        stats.done(f"q{i}")
    assert f.in_flight == 0 and stats.where("q0") is None
    # A reservation moves when Serve takes another replica; a second one there is a no-op.
    stats.reserve("m", "a", 4, now=t0)
    stats.reserve("m", "b", 6, now=t0)
    stats.reserve("m", "b", 6, now=t0)
    assert (f.sent_blocks, f.in_flight, stats.get("b").sent_blocks, stats.get("b").in_flight) == (0, 0, 6, 1)
    stats.retain(["a"])
    assert "b" not in stats.replicas and stats.where("m") is None


def test_a_poll_brings_hashes_and_assumed_ones_last_until_a_later_poll():
    stats = _stats_with({})
    ids = prompt(320)
    hashes = chain_hashes(ids, BS)
    t0 = 1000.0
    load = WorkerLoad(1, 0, 180, 200, 0.0, 0, 0, 0, 0, 0, 0, 0, worker="a", time=t0)
    poll = asdict(load) | {"cached": hashes[:10]}
    stats.observe_poll("a", poll)
    f = stats.get("a")
    assert (f.free_blocks, f.running) == (180, 1) and routing.prefix_hit(hashes, f.held) == 10
    other = chain_hashes(prompt(320, seed=1), BS)
    stats.reserve("q", "a", 25, other, now=t0 + 0.5)
    assert routing.prefix_hit(other, f.held) == len(other)  # assumed held from the moment it is sent
    stats.observe_poll("a", dict(poll, time=t0 + 0.55))  # taken too soon after the send to show it
    assert routing.prefix_hit(other, f.held) == len(other)
    stats.observe_poll("a", dict(poll, time=t0 + 0.5 + 2 * GRACE_S, cached=hashes[:4]))
    assert routing.prefix_hit(other, f.held) == 0 and routing.prefix_hit(hashes, f.held) == 4


def test_round_robin_and_least_requests():
    assert routing.round_robin_rank(3, 0) == [0, 1, 2]
    assert routing.round_robin_rank(3, 4) == [1, 2, 0]
    rr = routing.get_policy("round-robin")
    assert [rr.choose(None, [fig()] * 3, BS, t).order[0] for t in range(4)] == [0, 1, 2, 0]
    stats = _stats_with({"a": fig(running=2), "b": fig(running=1, waiting=1), "c": fig(running=1)})
    figs = [stats.get(n) for n in "abc"]
    assert routing.least_requests_rank(figs) == [2, 0, 1]
    stats.reserve("q1", "c", 0, now=time.time())
    stats.reserve("q2", "c", 0, now=time.time())
    assert routing.least_requests_rank(figs) == [0, 1, 2]  # ties: the lower index
    # This process's own count in flight counts where the report is older.
    stats.ack("q1")
    stats.ack("q2")
    figs[2].running = figs[2].waiting = 0
    assert routing.queue_depth(figs[2]) == 2


def test_binary_search_hit_count_equals_a_linear_scan():
    rng = random.Random(7)
    for _ in range(300):
        # A cache as engines hold one: whole prefixes of a few chains sharing some blocks.
        base = [rng.randrange(500) for _ in range(rng.randrange(0, 40) * 4)]
        chains = [
            chain_hashes(base + [rng.randrange(500) for _ in range(rng.randrange(0, 40) * 4)], 4)
            for _ in range(rng.randrange(1, 5))
        ]
        held = {h for c in chains for h in c[: rng.randrange(0, len(c) + 1)]}
        query = chain_hashes(base + [rng.randrange(500) for _ in range(rng.randrange(0, 40) * 4)], 4)
        query = rng.choice([query, *chains])
        linear = next((i for i, h in enumerate(query) if h not in held), len(query))
        limit = rng.randrange(0, len(query) + 2)
        assert routing.prefix_hit(query, held) == linear
        assert routing.prefix_hit(query, held, limit) == min(linear, limit)
        # kv_rank inlines the same search: the blocks it charges are the need less that hit.
        need = routing.RequestNeed(query, limit, 4 * len(query) + 1, len(query) + 3, 4)
        f = ReplicaFigures(free_blocks=1000, total_blocks=1000, held=dict.fromkeys(held, 0.0))
        hit = min(linear, limit)
        assert routing.kv_rank([f], need) == [(0, len(query) + 3 - hit, 4 * len(query) + 1 - 4 * hit)]


# ---- the Serve request router (no cluster: called as Serve calls it) ----------------


def _replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={})


def _pending(req):
    return SimpleNamespace(args=[req], kwargs={}, routing_context=SimpleNamespace(should_backoff=False))


def test_choose_replicas_ranks_one_per_rank_sets_backoff_and_reserves(monkeypatch):
    from shoal.router.routing.request_router import PolicyRequestRouter

    stats = _stats_with({"a": fig(running=3), "b": fig()})
    monkeypatch.setattr(replica_stats, "REGISTRY", stats)
    router = PolicyRequestRouter.__new__(PolicyRequestRouter)  # as Serve calls it, without its state
    reps = [_replica("a"), _replica("b")]
    pending = _pending(request(prompt(100), rid="x"))
    ranks = asyncio.run(PolicyRequestRouter.choose_replicas(router, reps, pending))
    assert ranks == [[reps[1]], [reps[0]]] and pending.routing_context.should_backoff
    assert stats.where("x") == "b" and stats.get("b").in_flight == 1
    # Serve took "a" after all (b was full): the reservation follows.
    PolicyRequestRouter.on_request_routed(router, pending, reps[0].replica_id, None)
    assert stats.where("x") == "a" and stats.get("b").in_flight == 0
    assert asyncio.run(PolicyRequestRouter.choose_replicas(router, [], pending)) == []
    info_call = SimpleNamespace(args=[], kwargs={}, routing_context=SimpleNamespace(should_backoff=False))
    assert len(asyncio.run(PolicyRequestRouter.choose_replicas(router, reps, info_call))) == 2


def test_choose_cost_at_32_replicas(monkeypatch):
    """The micro-benchmark: 32 replicas holding ~1000 hashes each, a
    2,000-token prompt; `pytest -s -k choose_cost` prints the figure."""
    from shoal.router.routing.request_router import PolicyRequestRouter

    rng = random.Random(3)
    ids = prompt(2000)
    hashes = chain_hashes(ids, BS)
    stats = ReplicaStats()
    stats.block_size = BS
    for i in range(32):
        held = [rng.getrandbits(63) for _ in range(1000)] + hashes[: rng.choice([0, 0, 0, 10, 60, 124])]
        stats.replicas[f"r{i}"] = fig(
            free=rng.randrange(500, 4000), total=4000, running=rng.randrange(8), waiting=rng.randrange(3), held=held
        )
    figs = list(stats.replicas.values())
    req = request(ids, max_tokens=512, rid="bench")
    n = 2000

    def per_call_us(fn) -> float:  # CPU time of this thread: the cores are shared with other work
        t = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - t) / n * 1e6

    pure = min(per_call_us(lambda: KV.choose(req, figs, BS)) for _ in range(3))
    # The whole choose_replicas as Serve awaits it, with the reservation (and its release).
    monkeypatch.setattr(replica_stats, "REGISTRY", stats)
    router, reps, pending = (
        PolicyRequestRouter.__new__(PolicyRequestRouter),
        [_replica(f"r{i}") for i in range(32)],
        _pending(req),
    )

    def choose_replicas():
        coro = router.choose_replicas(reps, pending)
        with pytest.raises(StopIteration):  # it never suspends
            coro.send(None)
        stats.done("bench")

    full = min(per_call_us(choose_replicas) for _ in range(3))
    loop = min(per_call_us(lambda: None) for _ in range(3))
    print(
        f"\nchoose at 32 replicas, 2,000-token prompt: {pure:.1f} us scoring, {full:.1f} us choose_replicas "
        f"(+ reserve and release); an empty call here: {loop:.2f} us"
    )
    assert pure < 1000 and full < 1000  # the goal is < 100 us; loose here, the cores are shared


# ---- the worker's side ---------------------------------------------------------


def test_block_pool_exports_cached_hashes_most_recent_first():
    pool = BlockPool(8, enable_caching=True)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(2)
    for i, block in enumerate(a):
        pool.cache_block(block, 100 + i)
    for i, block in enumerate(b):
        pool.cache_block(block, 200 + i)
    assert pool.cached_hashes_mru(10) == [100, 101, 102, 200, 201]  # in use: in the order cached
    pool.free(list(reversed(a)))  # as a sequence is freed: tail first
    assert pool.cached_hashes_mru(10) == [200, 201, 100, 101, 102]  # in use, then the freed, prefix first
    pool.free(list(reversed(b)))
    assert pool.cached_hashes_mru(10) == [200, 201, 100, 101, 102]
    assert pool.cached_hashes_mru(3) == [200, 201, 100]
    pool.get_new_blocks(4)  # the 3 uncached free blocks, then the least recently freed: 102, a tail
    assert pool.cached_hashes_mru(10) == [200, 201, 100, 101]
    assert BlockPool(4, enable_caching=False).cached_hashes_mru(10) == []


def test_block_pool_keeps_its_in_use_cached_index_under_random_use():
    """in_use_cached (what makes the export O(limit)) is exactly the blocks
    in use that hold a hash, through random allocation, hits and frees."""
    rng = random.Random(1)
    pool = BlockPool(32, enable_caching=True)
    live: list[list[int]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks >= 3:
            blocks = pool.get_new_blocks(rng.randrange(1, 4))
            for b in blocks:
                if rng.random() < 0.7:
                    h = rng.randrange(40)
                    pool.cache_block(b, h)
            live.append(blocks)
        elif op < 0.6:
            h = rng.randrange(40)
            b = pool.lookup(h)
            if b is not None:
                pool.touch([b])
                live.append([b])
        elif live:
            pool.free(list(reversed(live.pop(rng.randrange(len(live))))))
        in_use = {b.block_id for b in pool.blocks if b.ref_cnt and b.block_hash is not None}
        assert set(pool.in_use_cached) == in_use
        exported = pool.cached_hashes_mru(1000)
        assert len(exported) == len(set(exported))
        assert set(exported) == {b.block_hash for b in pool.blocks if b.block_hash is not None}
        few = pool.cached_hashes_mru(5)  # (two blocks in use may share a hash: then a free one fills in)
        assert len(few) == min(5, len(exported)) and set(few) <= set(exported)


def test_local_pool_routes_a_shared_prefix_to_its_holder_and_exports_it(tiny_model):
    """The fast tier's end to end: Workers in-process behind LocalWorkerPool
    (the `kv` scoring), their delta loads and routing stats."""
    from shoal.router.routing.worker_pool import LocalWorkerPool
    from shoal.workers import EngineArgs
    from shoal.workers.worker import Worker

    workers = [Worker(EngineArgs(model=tiny_model, num_kv_blocks=64), max_waiting=8) for _ in range(2)]
    pool = LocalWorkerPool(workers)
    shared = prompt(200, seed=5)

    async def one(ids, rid):
        msgs = [m async for m in pool.generate(request(ids, max_tokens=4, rid=rid))]
        # The worker's load rides on the first and last delta (and on those of a step every LOAD_EVERY_S).
        assert msgs[0].load is not None and msgs[-1].load is not None
        assert all(m.load.worker == msgs[-1].finished.worker for m in msgs if m.load is not None)
        return msgs[-1].finished

    async def main():
        # A burst of two different prompts spreads over both workers...
        firsts = await asyncio.gather(one(shared + [7], "s0"), one(prompt(200, seed=6), "o0"))
        # ...then requests sharing the first one's prefix follow it, and hit its cache.
        later = [await one(shared + [10 + i, 11], f"s{i + 1}") for i in range(3)]
        return firsts, later

    firsts, later = asyncio.run(main())
    assert firsts[0].worker != firsts[1].worker
    assert all(f.worker == firsts[0].worker for f in later)
    assert all(f.num_cached_tokens >= 192 for f in later)
    holder = next(w for w in workers if w.name == firsts[0].worker)
    stats = holder.record_routing_stats()
    assert set(chain_hashes(shared, BS)) <= set(stats["cached"])
    assert stats["num_total_blocks"] == 64 and stats["num_running"] == 0 and holder.record_routing_stats() is stats
    # One report, the deltas' WorkerLoad, as a dict: its fields and the hashes, read back whole.
    assert set(stats) == {f.name for f in fields(WorkerLoad)} | {"cached", "offloaded"}
    assert stats["offloaded"] == []  # no KV tier here
    assert WorkerLoad.from_dict(stats).worker == holder.name
    for w in workers:
        asyncio.run(w.engine.shutdown())


# ---- options ---------------------------------------------------------------------


def test_routing_option_in_cli_and_serve_config():
    import subprocess
    import sys

    from shoal.cluster.app import worker_deployment_options
    from shoal.cluster.options import ServeOptions
    from shoal.router.routing.request_router import PolicyRequestRouter, Pow2Router

    opts = ServeOptions.from_dict({})
    assert opts.routing == "kv" and ServeOptions.from_dict(opts.to_dict()).routing == "kv"
    cfg = worker_deployment_options(opts, gpu=False)["request_router_config"]
    assert cfg.request_router_class.endswith(PolicyRequestRouter.__name__) and cfg.request_routing_stats_period_s < 1
    cfg = worker_deployment_options(ServeOptions.from_dict({"routing": "pow2"}), gpu=False)["request_router_config"]
    assert cfg.request_router_class.endswith(Pow2Router.__name__)
    with pytest.raises(
        ValueError, match="unknown routing policy 'random'; known: kv, least-requests, pow2, round-robin"
    ):
        ServeOptions.from_dict({"routing": "random"})
    out = subprocess.run(
        [sys.executable, "-m", "shoal.cluster.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "--routing {kv,least-requests,pow2,round-robin}" in out


# ---- slow tier: a served cluster -------------------------------------------------


@pytest.mark.slow
def test_served_kv_routing_keeps_a_shared_prefix_on_its_holder(tiny_model):
    """Two workers behind `--routing kv` on a real local Ray cluster: a burst
    of two prompts spreads over both; then requests sharing either prompt's
    long prefix land on the worker that served it, and hit its cache."""
    import grpc
    import ray
    from ray import serve
    from serving import free_port
    from test_tp_cluster import wait_healthy

    from shoal.cluster.app import build_app
    from shoal.proto.v1 import shoal_pb2 as pb
    from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

    prefixes = {"a": prompt(320, seed=11), "b": prompt(320, seed=12)}  # 20 blocks each

    def call(stub, group: str, suffix: list[int], max_tokens: int):
        ids = pb.TokenIds(ids=prefixes[group] + suffix)
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return stub.Generate(pb.GenerateRequest(token_ids=ids, sampling=sampling), timeout=60)

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, logging_level="WARNING")
    http, grpc_port = free_port(), free_port()
    try:
        serve.start(proxy_location="Disabled")
        opts = dict(
            model=tiny_model,
            num_workers=2,
            routing="kv",
            http_port=http,
            grpc_port=grpc_port,
            num_threads=1,
            num_kv_blocks=128,
            max_num_seqs=8,
            device="cpu",
        )
        serve.run(build_app(opts), name="shoal-kv", route_prefix=None)
        wait_healthy(f"http://127.0.0.1:{http}", 120)

        async def burst():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                stub = pb_grpc.ShoalStub(ch)
                calls = [call(stub, g, [5], 48) for g in "ab"]
                return [[m async for m in c][-1].finished for c in calls]

        first = dict(zip("ab", asyncio.run(burst())))
        assert first["a"].worker != first["b"].worker  # optimistic accounting spread the burst
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            stub = pb_grpc.ShoalStub(ch)
            later = [(g, list(call(stub, g, [20 + i, 7], 4))[-1].finished) for i, g in enumerate("aabab")]
    finally:
        serve.shutdown()
        ray.shutdown()
    for g, fin in later:
        assert fin.worker == first[g].worker, (g, fin.worker, first)
        assert fin.usage.cached_tokens >= 320  # the whole shared prefix, from that worker's cache
