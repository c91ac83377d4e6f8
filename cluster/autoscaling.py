"""Autoscaling the Worker deployment on queue depth: a Ray Serve deployment
policy (a function), fed by each worker's `record_autoscaling_stats`
(workers/worker.py: waiting, running, KV usage, max running).

The rule, over the latest report of every running worker:

    need = max(ceil(waiting / target_queue_depth),   # the queue, spread thin enough
               ceil(sum(running / max_running)),      # the sequences running now, each
                                                      #   worker running at most max_num_seqs
               ceil(sum(kv_usage) / KV_HIGH))         # the KV cache in use, each worker
                                                      #   at most KV_HIGH full
    if waiting: need = max(need, the current target)  # never down while requests wait
    desired = need clamped to [min_workers, max_workers]

`waiting` counts the requests every worker has waiting, plus those queued
in Serve's handles (not yet at a worker). So the queue drives scale-up, and
the last two terms are the floor that scale-down keeps: the workers left
must be able to run what is running now and hold its KV cache under
KV_HIGH. Serve applies --upscale-delay-s and --downscale-delay-s on top (a
change happens once the policy has wanted it that long without a break),
and picks which replica goes; that replica drains first (Serve stops
routing to it, and its streams finish, up to graceful_shutdown_timeout_s).

--target-queue-depth travels as the AutoscalingConfig's
`target_ongoing_requests` (read by Serve's built-in policy only), since a
policy function gets no arguments of its own. Serve pickles this module by
value into its controller: it imports nothing of shoal's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A worker's KV cache is counted full past this share: scale-down keeps
# enough workers to hold the KV in use under it, and more is scale-up.
KV_HIGH = 0.8
# How often a worker's figures reach Serve's controller (its replicas sample
# them at least this often, too). Serve's default is 10 s.
METRICS_INTERVAL_S = 0.5
LOOK_BACK_PERIOD_S = 2.0
# Serve's drain checks a stopping replica's requests this often (default 2 s).
DRAIN_CHECK_S = 0.5
POLICY = f"{__name__}:worker_policy"
STATS = ("waiting", "running", "kv_usage", "max_running")  # the keys record_autoscaling_stats reports


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """One worker's latest report."""

    waiting: float
    running: float
    kv_usage: float  # share of KV blocks in use, 0..1
    max_running: float  # its max_num_seqs


def desired_workers(
    figs: Sequence[WorkerFigures],
    current: int,
    min_workers: int,
    max_workers: int,
    target_queue_depth: float,
    queued: float = 0.0,
) -> int:
    """The module docstring's rule. `current` is Serve's current target,
    `queued` the requests waiting in Serve's handles."""
    waiting = queued + sum(f.waiting for f in figs)
    need = max(
        math.ceil(waiting / target_queue_depth - 1e-9),
        math.ceil(sum(f.running / max(f.max_running, 1.0) for f in figs) - 1e-9),
        math.ceil(sum(f.kv_usage for f in figs) / KV_HIGH - 1e-9),
    )
    if waiting > 0:
        need = max(need, current)
    return max(min_workers, min(max_workers, need))


def latest_figures(raw_metrics: dict | None, replicas) -> list[WorkerFigures]:
    """The latest sample of each of STATS per replica (from Serve's
    `raw_metrics`: name -> replica id -> time series); a replica that has
    not reported every key yet is left out."""
    raw = raw_metrics or {}
    figs = []
    for rid in replicas:
        series = [raw.get(key, {}).get(rid) for key in STATS]
        if all(series):
            figs.append(WorkerFigures(*(float(s[-1].value) for s in series)))
    return figs


def worker_policy(ctx) -> tuple[int, dict]:
    """Serve's deployment-level policy: `ctx` is an AutoscalingContext."""
    figs = latest_figures(ctx.raw_metrics, ctx.running_replicas)
    if not figs:  # nothing reported yet: stay
        return ctx.target_num_replicas, {}
    queued = ctx.total_queued_requests or 0.0
    desired = desired_workers(
        figs,
        ctx.target_num_replicas,
        ctx.capacity_adjusted_min_replicas,
        ctx.capacity_adjusted_max_replicas,
        ctx.config.target_ongoing_requests,
        queued,
    )
    return desired, {}


def replica_options(opts) -> dict:
    """The Worker deployment's replica-count options for ServeOptions `opts`:
    a fixed `num_replicas`, or, with max_workers set, an autoscaling config
    starting at num_workers (clamped to the range)."""
    if opts.max_workers is None:
        return {"num_replicas": opts.num_workers}
    low, high = opts.min_workers or 1, opts.max_workers
    return {
        "autoscaling_config": {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": max(low, min(high, opts.num_workers)),
            "target_ongoing_requests": opts.target_queue_depth,
            "upscale_delay_s": opts.upscale_delay_s,
            "downscale_delay_s": opts.downscale_delay_s,
            "metrics_interval_s": METRICS_INTERVAL_S,
            "look_back_period_s": LOOK_BACK_PERIOD_S,
            "policy": {"policy_function": POLICY},
        },
        "graceful_shutdown_wait_loop_s": DRAIN_CHECK_S,
    }
