"""Autoscaling on queue depth, fast tier: the policy's rule over plain
figures and over a stand-in for Serve's AutoscalingContext; the flags into
the Worker deployment's options; a worker handing back waiting requests and
the failover pool sending them on (the cluster's test is the slow tier's)."""

from __future__ import annotations

import asyncio
import time
from collections import namedtuple
from contextlib import aclosing
from types import SimpleNamespace

import pytest
from prompts import SHORT_PROMPTS

from shoal.cluster.autoscaling import KV_HIGH, WorkerFigures, desired_workers, worker_policy
from shoal.cluster.options import ServeOptions
from shoal.proto.messages import GenerateRequest, WorkerError
from shoal.router.routing import rebalance
from shoal.router.routing.failover import FailoverPool
from shoal.router.routing.replica_stats import ReplicaStats
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.worker import Worker


def idle(n: int = 1, max_running: float = 4.0) -> list[WorkerFigures]:
    return [WorkerFigures(0.0, 0.0, 0.0, max_running) for _ in range(n)]


def test_the_queue_raises_workers_to_the_target_depth_within_the_bounds():
    one = [WorkerFigures(waiting=7.0, running=4.0, kv_usage=0.2, max_running=4.0)]
    assert desired_workers(one, current=1, min_workers=1, max_workers=8, target_queue_depth=2.0) == 4  # ceil(7 / 2)
    assert desired_workers(one, 1, 1, 3, 2.0) == 3  # the max bounds it
    assert desired_workers(one, 1, 1, 8, 10.0) == 1  # within the target: stay
    # Requests queued in Serve's handles wait too.
    assert desired_workers(one, 1, 1, 8, 2.0, queued=3.0) == 5
    assert desired_workers(idle(), 1, 2, 8, 2.0) == 2  # the min holds even when idle


def test_down_only_when_no_request_waits():
    busy = [WorkerFigures(1.0, 1.0, 0.1, 4.0), *idle(2)]
    assert desired_workers(busy, current=3, min_workers=1, max_workers=3, target_queue_depth=4.0) == 3
    assert desired_workers(idle(3), 3, 1, 3, 4.0) == 1  # idle: back to the min
    # Running requests hold as many workers as it takes to run them at once.
    running = [WorkerFigures(0.0, 3.0, 0.1, 4.0), WorkerFigures(0.0, 3.0, 0.1, 4.0), *idle(1)]
    assert desired_workers(running, 3, 1, 3, 2.0) == 2  # 6 running, 4 per worker


def test_kv_in_use_keeps_and_adds_workers():
    # Three workers half full: the KV in use needs two at KV_HIGH (0.8) each.
    half = [WorkerFigures(0.0, 1.0, 0.5, 64.0) for _ in range(3)]
    assert desired_workers(half, 3, 1, 4, 2.0) == 2
    # One worker past KV_HIGH: more, even with nothing waiting.
    full = [WorkerFigures(0.0, 8.0, 0.95, 64.0)]
    assert KV_HIGH < 0.95 and desired_workers(full, 1, 1, 4, 2.0) == 2


TSV = namedtuple("TSV", "timestamp value")  # Serve's TimeStampedValue, as the policy reads it


def context(reports: dict[str, dict], target: int, running=None, queued: float = 0.0, lo: int = 1, hi: int = 3):
    raw: dict = {}
    for rid, figs in reports.items():
        for key, value in figs.items():
            raw.setdefault(key, {})[rid] = [TSV(0.0, -1.0), TSV(1.0, value)]  # the latest counts
    return SimpleNamespace(
        raw_metrics=raw,
        running_replicas=list(running or reports),
        target_num_replicas=target,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        total_queued_requests=queued,
        config=SimpleNamespace(target_ongoing_requests=2.0),
    )


def test_policy_reads_the_latest_report_of_each_running_worker():
    deep = {"waiting": 9.0, "running": 2.0, "kv_usage": 0.1, "max_running": 2.0}
    assert worker_policy(context({"a": deep}, target=1)) == (3, {})
    # A worker that has not reported every figure yet counts as nothing; none reported: stay.
    assert worker_policy(context({"a": {"waiting": 0.0}}, target=2, running=["a", "b"])) == (2, {})
    quiet = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0, "max_running": 2.0}
    assert worker_policy(context({"a": quiet, "b": quiet, "c": quiet}, target=3)) == (1, {})
    assert worker_policy(context({"a": quiet}, target=1, queued=5.0)) == (3, {})


def test_autoscaling_flags_round_trip_into_the_worker_deployment():
    from ray.serve.config import AutoscalingConfig

    from shoal.cluster.app import worker_deployment_options
    from shoal.cluster.cli import build_parser

    ns = build_parser().parse_args(
        [
            "serve",
            "--num-workers",
            "5",
            "--min-workers",
            "2",
            "--max-workers",
            "4",
            "--target-queue-depth",
            "3",
            "--upscale-delay",
            "1",
            "--downscale-delay-s",
            "7",
            "--device",
            "cpu",
        ]
    )
    opts = ServeOptions.from_cli_args(ns)
    assert (opts.min_workers, opts.max_workers, opts.target_queue_depth) == (2, 4, 3.0)
    assert (opts.upscale_delay_s, opts.downscale_delay_s) == (1.0, 7.0)
    assert ServeOptions.from_dict(opts.to_dict()) == opts  # a Serve config's args carry them back
    worker = worker_deployment_options(opts, gpu=False)
    assert "num_replicas" not in worker and worker["graceful_shutdown_wait_loop_s"] <= 1.0
    with pytest.warns(DeprecationWarning):  # metrics_interval_s: deprecated by Serve, still the push period
        config = AutoscalingConfig(**worker["autoscaling_config"])
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (2, 4, 4)  # 5 workers, clamped
    assert (config.upscale_delay_s, config.downscale_delay_s, config.target_ongoing_requests) == (1.0, 7.0, 3.0)
    assert config.metrics_interval_s <= 1.0
    assert config.policy.get_policy()(context({}, target=3)) == (3, {})  # Serve's copy of worker_policy
    # Without --max-workers: a fixed count, as before; the threads count the most workers.
    assert worker_deployment_options(ServeOptions(num_workers=2), gpu=False)["num_replicas"] == 2
    assert "autoscaling_config" not in worker_deployment_options(ServeOptions(), gpu=False)
    assert (
        opts.worker_engine_args(gpu=False).num_threads
        == ServeOptions(num_workers=4).worker_engine_args(False).num_threads
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"min_workers": 2}, "min_workers needs max_workers"),
        ({"max_workers": 2, "min_workers": 3}, r"max_workers \(2\) must be >= min_workers \(3\)"),
        ({"max_workers": 2, "min_workers": 0}, "min_workers must be >= 1"),
        ({"max_workers": 2, "target_queue_depth": 0}, "target_queue_depth must be > 0"),
        ({"max_workers": 2, "downscale_delay_s": -1}, "must be >= 0"),
    ],
)
def test_autoscaling_options_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        ServeOptions.from_dict(bad)


# ---- rebalancing ------------------------------------------------------------


def test_a_new_worker_gets_the_mean_share_of_the_waiting_requests():
    assert rebalance.shares({"a": 12, "b": 0}, new={"b"}) == {"a": 6}
    assert rebalance.shares({"a": 9, "b": 4, "c": 0}, new={"c"}) == {"a": 5}  # b holds under its share
    assert rebalance.shares({"a": 1, "b": 0}, new={"b"}) == {}  # nothing deep enough to move
    assert rebalance.shares({"a": 9, "b": 0}, new=()) == {}

    stats = ReplicaStats()
    r = rebalance.Rebalancer(handle=None)
    stats.observe_load("a", 100, 128, running=2, waiting=10)
    assert r.plan(stats) == {}  # the first worker seen is new, but none is old
    stats.get("b")  # known to the router, not reported yet: not ready
    assert r.plan(stats) == {}
    stats.observe_load("b", 128, 128, running=0, waiting=0)
    assert r.plan(stats) == {"a": 5}
    assert r.plan(stats) == {}  # once per new worker
    stats.drop("b")  # b drains away; a delta of its last stream brings its figures back: not new
    stats.observe_load("b", 128, 128, running=1, waiting=0)
    assert r.plan(stats) == {}


class MovingPool:
    """First sends go to worker a; a request sent again (its id gets a
    suffix) goes to worker b."""

    def __init__(self, a: Worker, b: Worker):
        self.a, self.b = a, b

    async def generate(self, request: GenerateRequest):
        worker = self.b if "-" in request.request_id else self.a
        async with aclosing(worker.generate(request)) as stream:
            async for msg in stream:
                yield msg


async def collect(stream) -> tuple[list[int], str, list]:
    tokens, text, finished = [], "", []
    async with aclosing(stream) as s:
        async for msg in s:
            assert not isinstance(msg, WorkerError), msg
            tokens += msg.token_ids
            text += msg.text
            finished += [msg.finished] if msg.finished else []
    return tokens, text, finished


def test_waiting_requests_handed_back_go_on_elsewhere_at_no_retry_cost(tiny_model):
    prompts = SHORT_PROMPTS[:6]

    async def main():
        a, b = (
            Worker(EngineArgs(model=tiny_model, num_kv_blocks=128, num_threads=1, max_num_seqs=1), max_waiting=64)
            for _ in range(2)
        )
        try:
            reqs = [
                GenerateRequest(
                    f"r{i}",
                    a.engine.engine.tokenize(p),
                    SamplingParams(temperature=0, max_tokens=300 if i == 0 else 24, ignore_eos=True),
                )
                for i, p in enumerate(prompts)
            ]
            refs = [await collect(b.generate(r)) for r in reqs]  # each alone, undisturbed
            pool = FailoverPool(MovingPool(a, b), max_retries=0)
            tasks = [asyncio.ensure_future(collect(pool.generate(r))) for r in reqs]
            deadline = time.monotonic() + 30
            while a.engine.engine.scheduler.num_waiting < 5 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            stats = a.record_autoscaling_stats()
            assert stats["waiting"] == 5.0 and stats["running"] == 1.0 and stats["max_running"] == 1.0
            assert 0.0 < stats["kv_usage"] < 1.0
            assert a.release_waiting({"someone-else": 0}) == 0  # not named: keeps all
            moved = a.release_waiting({a.name: 2})  # keep 2 of 5: the newest 3 go
            got = await asyncio.gather(*tasks)
            return moved, refs, got, pool
        finally:
            for w in (a, b):
                await w.engine.shutdown()

    moved, refs, got, pool = asyncio.run(main())
    assert moved == 3 and pool.num_failovers == 0  # max_retries=0: a move costs none
    for (tokens, text, fin), (ref_tokens, ref_text, _) in zip(got, refs):
        assert tokens == ref_tokens and text == ref_text and len(fin) == 1
    workers = [fin[0].worker for _, _, fin in got]
    assert workers[:3] == [workers[0]] * 3 and len(set(workers[3:])) == 1 and workers[3] != workers[0]
