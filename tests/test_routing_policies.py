"""Routing policies as objects (router/routing/policies/): the registry lists
each once and every flag, config and chart reads it; an unknown name is a
ValueError naming the known ones, wherever it is given; each policy ranks
hand-built replica figures as it should; and what a policy declares it
reads drives what its callers compute and poll."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
from types import SimpleNamespace

import pytest
import yaml

from shoal.proto.block_hash import chain_hashes
from shoal.proto.lora.modules import LORA_ON_DEVICE
from shoal.proto.messages import GenerateRequest, WorkerLoad
from shoal.proto.sampling_params import SamplingParams
from shoal.router.routing import policies
from shoal.router.routing.policies import registry
from shoal.router.routing.policies.kv import kv_rank
from shoal.router.routing.policies.need import need_of
from shoal.router.routing.replica_stats import DEFAULT_FETCH_RATIO, ReplicaFigures, ReplicaStats, tier_ratios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 16
NEEDS = ("needs_load", "needs_prefix", "needs_adapters", "serve_builtin")


def fig(running=0, waiting=0, free=200, held=(), loras=None) -> ReplicaFigures:
    f = ReplicaFigures(free, 200, running, waiting, 0, reported_at=1.0, held=dict.fromkeys(held, 0.0))
    f.loras = {name: (i + 1, where) for i, (name, where) in enumerate((loras or {}).items())}
    return f


def request(ids=tuple(range(3, 163)), rid="r", lora=None, group=None) -> GenerateRequest:
    ids = list(ids)
    return GenerateRequest(
        rid,
        ids,
        SamplingParams(max_tokens=32),
        block_hashes=chain_hashes(ids, BS),
        lora_name=lora,
        parent_request_id=group,
    )


class ReadsNothing:
    """A policy that reads no report: the first replica, always."""

    name = "first"
    summary = "the first worker"
    needs_load = needs_prefix = needs_adapters = serve_builtin = False

    def choose(self, request, figs, block_size, turn=0):
        return policies.Ranking(list(range(len(figs))))


# ---- the registry ----------------------------------------------------------------


def test_the_registry_lists_every_policy_module_once_by_its_name():
    assert policies.POLICY_NAMES == ("kv", "least-requests", "pow2", "round-robin")
    assert all(name == p.name for name, p in policies.POLICIES.items())
    # Every policy class in the package is registered, once.
    found = []
    for mod in pkgutil.iter_modules(policies.__path__):
        module = importlib.import_module(f"{policies.__name__}.{mod.name}")
        found += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    classes = [c for c in found if hasattr(c, "choose") and hasattr(c, "name")]
    assert sorted(type(p).__name__ for p in policies.POLICIES.values()) == sorted(c.__name__ for c in classes)
    for p in policies.POLICIES.values():  # the protocol's attributes, declared
        assert isinstance(p.summary, str) and p.summary
        assert all(isinstance(getattr(p, a), bool) for a in NEEDS)


def test_a_new_policy_is_one_module(tmp_path, monkeypatch):
    """A module holding a POLICY, dropped beside the others, is a policy: no
    list to extend anywhere else."""
    (tmp_path / "first_worker.py").write_text(
        "class FirstPolicy:\n"
        "    name = 'first'\n"
        "    summary = 'the first worker'\n"
        "    needs_load = needs_prefix = needs_adapters = serve_builtin = False\n\n"
        "    def choose(self, request, figs, block_size, turn=0):\n"
        "        from shoal.router.routing.policies.base import Ranking\n\n"
        "        return Ranking(list(range(len(figs))))\n\n\n"
        "POLICY = FirstPolicy()\n"
    )
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(tmp_path)])  # where the import looks
    try:
        found = registry._discover(list(policies.__path__))
        assert set(found) == {*policies.POLICY_NAMES, "first"}
        assert found["first"].choose(None, [None, None], 16).order == [0, 1]
    finally:
        sys.modules.pop(f"{policies.__name__}.first_worker", None)


def test_the_flag_the_serve_config_and_the_chart_read_the_registry():
    from shoal.cluster.options import ServeOptions
    from shoal.router.options import RouterOptions

    field = {f.name: f for f in dataclasses.fields(ServeOptions)}["routing"]
    assert (
        field.default
        == policies.DEFAULT_POLICY
        == {f.name: f for f in dataclasses.fields(RouterOptions)}["routing"].default
    )
    assert tuple(field.metadata["choices"]) == policies.POLICY_NAMES
    assert all(f"{p.name} = {p.summary}" in field.metadata["help"] for p in policies.POLICIES.values())
    for name in policies.POLICY_NAMES:
        assert ServeOptions.from_dict({"routing": name}).routing == name
    # The chart's schema cannot import the registry, so it lists no names (a new
    # policy touches no chart file): it takes any name and the Serve config's
    # check, which reads the registry, refuses an unknown one at start.
    with open(os.path.join(ROOT, "helm", "shoal", "values.schema.json")) as f:
        schema = json.load(f)
    routing = schema["properties"]["shoal"]["properties"]["routing"]
    assert "enum" not in routing and all(re.fullmatch(routing["pattern"], n) for n in policies.POLICY_NAMES)
    with open(os.path.join(ROOT, "helm", "shoal", "values.yaml")) as f:
        assert yaml.safe_load(f)["shoal"]["routing"] is None  # the registry's default


@pytest.mark.parametrize("name", ["random", "KV", "", None])
def test_an_unknown_name_is_a_value_error_naming_the_known_ones(name):
    from shoal.cluster.options import ServeOptions
    from shoal.router.routing.request_router import PolicyRequestRouter, request_router_config
    from shoal.router.routing.worker_pool import LocalWorkerPool

    known = "known: kv, least-requests, pow2, round-robin"
    with pytest.raises(ValueError, match=f"unknown routing policy {name!r}; {known}"):
        policies.get_policy(name)
    with pytest.raises(ValueError, match=known):
        LocalWorkerPool([SimpleNamespace()], name)  # never a fallback to another policy
    with pytest.raises(ValueError, match=known):
        ServeOptions.from_dict({"routing": name})
    with pytest.raises(ValueError, match=known):
        request_router_config(name)
    router = PolicyRequestRouter.__new__(PolicyRequestRouter)
    with pytest.raises(ValueError, match=known):
        router.initialize_state(policy=name)


# ---- each policy's ranking ---------------------------------------------------------


@pytest.mark.parametrize("name", policies.POLICY_NAMES)
def test_every_policy_ranks_every_replica_once(name):
    p = policies.get_policy(name)
    figs = [fig(running=r) for r in (3, 0, 2, 5, 1)]
    for req in (request(), None):
        for turn in range(3):
            order, blocks, tokens = p.choose(req, figs, BS, turn)
            assert sorted(order) == list(range(5)) and blocks >= 0 and tokens >= 0
    assert p.choose(request(), [], BS).order == []
    assert p.choose(request(), [fig()], BS).order == [0]


def test_kv_ranks_by_prefix_held_and_load_and_says_what_the_request_takes():
    kv, req = policies.get_policy("kv"), request()  # 160 tokens: 10 blocks, 9 usable
    holder = fig(running=2, held=req.block_hashes[:6])
    assert kv.choose(req, [fig(running=1), holder], BS) == ([1, 0], 12 - 6, 160 - 6 * BS)
    assert kv.choose(req, [fig(running=2), fig(running=1)], BS).order == [1, 0]
    # No request (a control call) or no block size yet: the fewest requests.
    assert kv.choose(None, [fig(running=2), fig(running=1)], BS) == ([1, 0], 0, 0)
    assert kv.choose(req, [fig(running=1), holder], 0) == ([0, 1], 0, 0)


def _tiered(running=0, held=(), offloaded=(), tier_ratio=0.1, cluster_ratio=-1.0) -> ReplicaFigures:
    f = fig(running=running, held=held)
    f.offloaded, f.tier_ratio, f.cluster_ratio = frozenset(offloaded), tier_ratio, cluster_ratio
    return f


def test_kv_scores_a_device_hit_above_a_tier_hit_above_a_miss():
    kv, req = policies.get_policy("kv"), request()  # 10 blocks, 9 usable
    six = req.block_hashes[:6]
    device, host, cold = _tiered(held=six), _tiered(offloaded=six), _tiered()
    assert kv.choose(req, [cold, host, device], BS).order == [2, 1, 0]
    # Fetched, not prefilled: the host holder takes all its blocks anew, and prefills the 4 the tier lacks.
    assert kv_rank([host], need_of(req, BS)) == [(0, 12, 160 - 6 * BS)]
    # The tiers go on where the device stops: 3 on the device and the next 3 in the tier beat 3 alone.
    split = _tiered(held=six[:3], offloaded=six[3:])
    assert kv.choose(req, [_tiered(held=six[:3]), split], BS).order == [1, 0]
    # A tier whose fetch costs what a prefill does saves nothing: a tie, the lower index first.
    assert kv.choose(req, [cold, _tiered(offloaded=six, tier_ratio=1.0)], BS).order == [0, 1]


def test_kv_weighs_a_device_hit_against_the_cluster_tier_that_everyone_reads():
    """With a cluster tier, a prefix any replica holds is a fetch away from
    all: the holder's edge shrinks to what a fetch costs, so load decides."""
    kv, req = policies.get_policy("kv"), request()
    six = req.block_hashes[:6]
    holder, idle = _tiered(running=1, held=six), _tiered()
    assert kv.choose(req, [holder, idle], BS).order == [0, 1]  # no cluster tier: 6 blocks outweigh a running request
    holder.cluster_ratio = idle.cluster_ratio = 0.2
    assert kv.choose(req, [holder, idle], BS).order == [1, 0]
    # ...and the idle one fetches those 6 blocks rather than prefill them.
    assert kv_rank([holder, idle], need_of(req, BS))[0] == (1, 12, 160 - 6 * BS)
    idle.cluster_ratio = 1.0  # a cluster no faster than a prefill: the holder again
    assert kv.choose(req, [holder, idle], BS).order == [0, 1]


def test_a_poll_brings_the_tiers_hashes_and_costs():
    stats = ReplicaStats()
    stats.block_size = BS
    hashes = request().block_hashes
    tiers = {
        "host": {"loaded_blocks": 10, "load_us": 1_000},  # 100 us a block
        "cluster": {"loaded_blocks": 4, "load_us": 64_000},  # 16 ms a block: no gain over a prefill
    }
    load = WorkerLoad(0, 0, 200, 200, 0.0, 0, 0, 0, 0, 0, 0, 0, worker="a", time=5.0, kv_tiers=tiers)
    load.prefill_us_per_token = 10.0  # 160 us a block prefilled
    poll = dataclasses.asdict(load) | {"cached": [], "offloaded": hashes[:3]}
    stats.observe_poll("a", poll)
    f = stats.get("a")
    assert f.offloaded == frozenset(hashes[:3])
    assert (f.tier_ratio, f.cluster_ratio) == (100 / 160, 1.0)
    # Not measured yet (no loads, or no prefill): the default; no cluster tier: -1.
    assert tier_ratios({"host": {"loaded_blocks": 0, "load_us": 0}}, 10.0, BS) == (DEFAULT_FETCH_RATIO, -1.0)
    assert tier_ratios(tiers, 0.0, BS) == (DEFAULT_FETCH_RATIO, DEFAULT_FETCH_RATIO)


def test_least_requests_ranks_by_queue_depth_and_ignores_prefixes():
    lr, req = policies.get_policy("least-requests"), request()
    figs = [fig(running=2, held=req.block_hashes), fig(waiting=1), fig(running=1, waiting=1)]
    assert lr.choose(req, figs, BS) == ([1, 0, 2], 0, 0)  # ties: the lower index


def test_round_robin_takes_each_in_turn_whatever_their_load():
    rr = policies.get_policy("round-robin")
    figs = [fig(running=9), fig(), fig(running=4)]
    assert [rr.choose(request(), figs, BS, turn).order for turn in (0, 1, 5)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]


def test_pow2_takes_the_less_loaded_of_two_at_random():
    p2 = policies.get_policy("pow2")
    for _ in range(50):
        assert p2.choose(request(), [fig(running=3), fig(running=1)], BS) == ([1, 0], 0, 0)
        # The busiest of three is never the lesser of two.
        assert p2.choose(request(), [fig(running=9), fig(running=1), fig(running=2)], BS).order[0] != 0
    firsts = {p2.choose(request(), [fig(running=9), fig(running=1), fig(running=2)], BS).order[0] for _ in range(200)}
    assert firsts == {1, 2}  # at random: the middle one wins where it is drawn with the busiest


def test_a_replica_lacking_the_adapter_comes_last_but_under_pow2():
    lacks, serves = fig(loras={"b": LORA_ON_DEVICE}), fig(running=3, loras={"a": LORA_ON_DEVICE})
    req = request(lora="a")
    for name, p in policies.POLICIES.items():
        first = p.choose(req, [lacks, serves], BS).order[0]
        assert first == (0 if not p.needs_adapters else 1), name
    assert not policies.get_policy("pow2").needs_adapters


# ---- what a policy reads drives its callers -------------------------------------------


def test_a_pinned_sibling_reserves_what_it_takes_there_only_under_a_prefix_reading_policy():
    req = request(rid="s1", group="g")
    for name, want in (("kv", (12 - 6, 160 - 6 * BS)), ("least-requests", (0, 0))):
        stats, names = ReplicaStats(), ["a", "b"]
        stats.block_size = BS
        stats.replicas.update(a=fig(running=5, held=req.block_hashes[:6]), b=fig())  # b looks better to both
        p = policies.get_policy(name)
        assert p.choose(req, [stats.get(n) for n in names], BS).order == [1, 0]
        assert policies.taken_at(p, req, stats.get("a"), BS) == want
        stats.reserve("s0", "a", 0, group="g")  # the group's first went to a
        assert policies.route(stats, p, req, names, [stats.get(n) for n in names]) == [0, 1]
        assert stats.get("a").sent_blocks == want[0] and stats.get("a").sent_tokens == want[1]


def test_serve_is_configured_from_what_the_policy_reads(monkeypatch):
    from shoal.router.routing import request_router as rr

    kv = rr.request_router_config("kv")
    assert kv.request_router_class.endswith(rr.PolicyRequestRouter.__name__)
    assert kv.request_router_kwargs == {"policy": "kv"} and kv.request_routing_stats_period_s < 1
    pow2 = rr.request_router_config("pow2")  # Serve's own router, which reads no routing stats of ours
    assert pow2.request_router_class.endswith(rr.Pow2Router.__name__) and pow2.request_router_kwargs == {}
    monkeypatch.setitem(registry.POLICIES, "first", ReadsNothing())
    quiet = rr.request_router_config("first")
    assert quiet.request_router_kwargs == {"policy": "first"} and quiet.request_routing_stats_period_s >= 1
    # Serve hands the kwargs to the router it makes in each process that routes.
    router = rr.PolicyRequestRouter.__new__(rr.PolicyRequestRouter)
    router.initialize_state(**quiet.request_router_kwargs)
    assert router.policy is registry.POLICIES["first"]
    assert rr.router_class("pow2") is rr.Pow2Router and rr.router_class("first") is rr.PolicyRequestRouter


class CountingWorker:
    """A stand-in worker that counts what the pool asks of it."""

    def __init__(self, name: str):
        self.name, self.polls, self.infos, self.got = name, 0, 0, []

    def record_routing_stats(self) -> dict:
        self.polls += 1
        return {}

    def info(self):
        self.infos += 1
        return SimpleNamespace(block_size=BS)

    async def generate(self, request):
        self.got.append(request.request_id)
        yield SimpleNamespace(load=None)


def _send(pool, n: int) -> None:
    async def main():
        for i in range(n):
            async for _ in pool.generate(request(rid=f"q{i}")):
                pass

    asyncio.run(main())


def test_the_in_process_pool_polls_and_reads_only_what_its_policy_reads(monkeypatch):
    from shoal.router.routing.worker_pool import LocalWorkerPool

    kv = LocalWorkerPool([CountingWorker("a"), CountingWorker("b")])
    assert kv.policy is policies.get_policy("kv")
    _send(kv, 2)
    assert [w.polls for w in kv.workers] == [1, 1] and kv.workers[0].infos == 1
    assert kv.replica_stats.block_size == BS

    rr = LocalWorkerPool([CountingWorker("a"), CountingWorker("b")], "round-robin")
    _send(rr, 4)
    assert [w.got for w in rr.workers] == [["q0", "q2"], ["q1", "q3"]]
    assert [w.polls for w in rr.workers] == [1, 1] and rr.workers[0].infos == 0  # adapters, not prefixes

    monkeypatch.setitem(registry.POLICIES, "first", ReadsNothing())
    quiet = LocalWorkerPool([CountingWorker("a"), CountingWorker("b")], "first")
    _send(quiet, 3)
    assert [len(w.got) for w in quiet.workers] == [3, 0]
    assert [w.polls for w in quiet.workers] == [0, 0] and quiet.workers[0].infos == 0

    pow2 = LocalWorkerPool([CountingWorker("a"), CountingWorker("b")], "pow2")  # its own rule, not round-robin
    _send(pow2, 1)
    assert sum(len(w.got) for w in pow2.workers) == 1
