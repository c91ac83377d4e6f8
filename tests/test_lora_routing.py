"""Routing on LoRA residency (router/routing/policies/lora.py): the kv policy
ranks a replica holding the request's adapter above one that must load it,
by a cost like a prefix miss; a replica that does not serve the adapter
comes last under every policy; the other policies are otherwise blind to
adapters; the registry keeps what the workers report and what this process
sent until a later report."""

from __future__ import annotations

import random
from dataclasses import asdict

from shoal.proto.block_hash import chain_hashes, lora_extra
from shoal.proto.lora.modules import LORA_IN_HOST, LORA_ON_DEVICE, LORA_ON_DISK, LORA_UNAVAILABLE
from shoal.proto.messages import GenerateRequest, WorkerLoad
from shoal.proto.sampling_params import SamplingParams
from shoal.router.routing import policies
from shoal.router.routing.replica_stats import GRACE_S, ReplicaFigures, ReplicaStats

BS = 16


def fig(loras: dict[str, int], running: int = 0, waiting: int = 0) -> ReplicaFigures:
    f = ReplicaFigures(200, 200, running, waiting, 0, reported_at=1.0)
    f.loras = {name: (i + 1, where) for i, (name, where) in enumerate(loras.items())}
    return f


def request(lora: str | None, n: int = 64, seed: int = 0) -> GenerateRequest:
    ids = [random.Random(seed).randrange(3, 500) for _ in range(n)]
    extra = b"" if lora is None else lora_extra(7)
    return GenerateRequest(
        f"r{random.random()}",
        ids,
        SamplingParams(max_tokens=32),
        0,
        None,
        chain_hashes(ids, BS, extra=extra),
        lora_name=lora,
    )


def order(policy: str, req, figs) -> list[int]:
    return policies.get_policy(policy).choose(req, figs, BS).order


def test_kv_prefers_the_replica_holding_the_adapter_device_over_host_over_disk():
    req = request("a")
    assert order("kv", req, [fig({"a": LORA_ON_DISK}), fig({"a": LORA_ON_DEVICE})])[0] == 1
    assert order("kv", req, [fig({"a": LORA_ON_DISK}), fig({"a": LORA_IN_HOST})])[0] == 1
    assert order("kv", req, [fig({"a": LORA_IN_HOST}), fig({"a": LORA_ON_DEVICE})])[0] == 1
    # The base model's requests do not look at adapters.
    assert (
        order("kv", request(None), [fig({"a": LORA_ON_DISK}, running=1), fig({"a": LORA_ON_DEVICE}, running=2)])[0] == 0
    )


def test_a_new_adapter_goes_where_fewest_adapters_are_held():
    req = request("c")
    busy = fig({"a": LORA_ON_DEVICE, "b": LORA_ON_DISK, "c": LORA_ON_DISK})
    free = fig({"a": LORA_ON_DISK, "b": LORA_ON_DISK, "c": LORA_ON_DISK})
    assert order("kv", req, [busy, free])[0] == 1
    # Held in host memory counts too: it is what a new adapter may push out.
    busy = fig({"a": LORA_ON_DEVICE, "b": LORA_IN_HOST, "c": LORA_ON_DISK})
    less = fig({"a": LORA_ON_DISK, "b": LORA_ON_DEVICE, "c": LORA_ON_DISK})
    assert order("kv", req, [busy, less])[0] == 1


def test_residency_is_a_cost_a_deep_queue_outweighs():
    req = request("a")
    # A few more queued requests at the holder do not send the adapter elsewhere ...
    assert order("kv", req, [fig({"a": LORA_ON_DISK}), fig({"a": LORA_ON_DEVICE}, running=2, waiting=1)])[0] == 1
    # ... a deep queue there does.
    assert order("kv", req, [fig({"a": LORA_ON_DISK}), fig({"a": LORA_ON_DEVICE}, running=8, waiting=8)])[0] == 0


def test_a_replica_not_serving_the_adapter_comes_last_under_every_policy():
    req = request("a")
    lacks, serves = fig({"b": LORA_ON_DEVICE}), fig({"a": LORA_ON_DISK}, running=5, waiting=5)
    for policy in ("kv", "least-requests", "round-robin"):
        assert order(policy, req, [lacks, serves]) == [1, 0], policy
    # An unreported replica (just started) is taken to serve it, at the cost of a load from disk.
    assert order("kv", req, [ReplicaFigures(), fig({"a": LORA_ON_DEVICE})]) == [1, 0]
    assert order("kv", req, [ReplicaFigures(), lacks]) == [0, 1]


def test_a_replica_that_could_not_load_the_adapter_comes_last_whatever_was_sent_there():
    req = request("a")
    broken = fig({"a": LORA_UNAVAILABLE, "b": LORA_ON_DEVICE})
    serves = fig({"a": LORA_ON_DISK}, running=5, waiting=5)
    broken.lora_sent["a"] = 1.0  # this process sent it a request under the adapter: still not there
    for policy in ("kv", "least-requests", "round-robin"):
        assert order(policy, req, [broken, serves]) == [1, 0], policy
    assert policies.lora_cost(broken, "a") >= policies.DOES_NOT_FIT
    # Unavailable is no adapter held there: it does not count against another adapter's cost.
    assert policies.lora_cost(broken, "c") >= policies.DOES_NOT_FIT
    assert policies.lora_cost(fig({"a": LORA_UNAVAILABLE, "c": LORA_ON_DISK}), "c") == policies.LORA_DISK_TOKENS


def test_least_requests_and_round_robin_are_otherwise_adapter_blind():
    req = request("a")
    figs = [fig({"a": LORA_ON_DEVICE}, running=3), fig({"a": LORA_ON_DISK})]
    assert order("least-requests", req, figs)[0] == 1
    assert [policies.get_policy("round-robin").choose(req, figs, BS, turn).order[0] for turn in (0, 1)] == [0, 1]


def test_registry_takes_reported_loras_and_assumes_a_sent_adapter_until_a_later_report():
    stats = ReplicaStats()
    stats.block_size = BS
    load = WorkerLoad(0, 0, 200, 200, 0.0, 0, 0, 0, 0, 0, 0, 0, worker="w0", time=100.0)
    load.loras = {"a": (1, LORA_ON_DISK), "b": (2, LORA_ON_DEVICE)}
    stats.observe_worker_load(load, taken_at=100.0)
    f = stats.get("w0")
    assert f.loras == {"a": (1, LORA_ON_DISK), "b": (2, LORA_ON_DEVICE)}
    assert policies.lora_cost(f, "b") == 0.0
    assert policies.lora_cost(f, "a") == policies.LORA_DISK_TOKENS + policies.LORA_HELD_TOKENS
    assert policies.lora_cost(f, "zzz") >= policies.DOES_NOT_FIT
    req = request("a")
    policies.route(stats, policies.get_policy("kv"), req, ["w0"], [f])
    assert f.lora_sent.keys() == {"a"} and policies.lora_cost(f, "a") == 0.0
    sent_at = f.lora_sent["a"]
    # A report from before the send leaves the assumption; one taken GRACE_S after it ends it.
    stats.observe_worker_load(load, taken_at=sent_at)
    assert "a" in f.lora_sent
    stats.observe_worker_load(load, taken_at=sent_at + 2 * GRACE_S)
    assert not f.lora_sent and policies.lora_cost(f, "a") > 0
    # The routing-stats poll carries the same figures as a dict (Serve's form).
    poll = asdict(load) | {"cached": [], "time": sent_at + 3 * GRACE_S}
    poll["loras"] = {"a": (1, LORA_IN_HOST)}
    stats.observe_poll("w0", poll)
    assert f.loras == {"a": (1, LORA_IN_HOST)}
