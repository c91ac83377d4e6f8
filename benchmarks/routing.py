"""`shoal bench routing`: every routing policy (--routing) on the same seeded
arrivals, in one run: one table, a JSON file and a plot.

One local Ray cluster per run: --workers-kind simulated (load_format
simulated, each worker a tiny CPU share, its steps --sim-speedup times faster
than the cost model says) or real (the model on logical GPUs: on a machine
without CUDA each worker computes on the CPU).
For each policy the application is deployed as `shoal serve` builds it
(build_app, ServeOptions.routing) and deleted after, so every policy starts
on cold caches; within a policy, each (workload, load) run has prompts of its
own, so no run hits what an earlier one cached. Requests go over HTTP, as
clients send them: OpenAI completions, prompts as token ids, streamed, with
usage (whose cached_tokens give the hit rate). The first --warmup-s seconds
of each run's arrivals warm the caches and are not counted.

Workloads (routing_workloads.py): `shared` (multi-turn chats over 8 long
system prompts, a working set several times one worker's cache), `unique`
(no shared prefix), `hot` (one system prompt takes most chats).

Loads: Poisson arrivals at 75% of pow2's knee on `shared` and at the knee,
where the knee is the first rate of --sweep-rates at which pow2's p99 TTFT
exceeds --knee-factor times its value at the lowest rate. The knee is kept
in the JSON and reused by a later run of the same setup; --rates skips it.

Reported per policy: TTFT p50/p99, E2E p99 (nearest rank: over a run's
~100 counted requests a p99 is its slowest one or two), output throughput,
goodput (requests whose TTFT is within --ttft-target-s), requests shed
(429/503), the prefix-cache hit rate beside the ideal one
(routing_workloads.replay through one cache the size of all workers'
together), and the spread (max - min) of the workers' KV usage, sampled every
0.5 s, averaged. The JSON also has each request's figures, and is rewritten
after every run: --resume keeps the policies that a stopped run finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from shoal.benchmarks.ports import free_port
from shoal.benchmarks.svg_plot import cdf_plot
from shoal.router.routing.policies import POLICY_NAMES as POLICIES
from shoal.workers.engine_args import EngineArgs

APP = "shoal-bench-routing"
SIM_CPUS_PER_WORKER = 0.05  # Ray CPUs a simulated worker asks for: it sleeps through its steps
KV_SAMPLE_S = 0.5
# pow2's sweep, in requests/s per worker of the calibrated CPU engine; each
# rate's run lasts long enough to count this many requests (a p99 of fewer is its maximum).
SWEEP_PER_WORKER = (0.03, 0.045, 0.065, 0.09, 0.13, 0.18, 0.25)
SWEEP_MIN_REQUESTS = 60
# The workers' own log lines stay in the cluster's log files (/tmp/ray/session_latest/logs).
RAY_QUIET = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": False}
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logging: no line per call
# The goals on `shared` (kv against pow2) and the guardrails elsewhere.
GOALS = {"75% knee": 2.0, "knee": 5.0}  # pow2 p99 TTFT / kv p99 TTFT at least
HIT_VS_POW2, HIT_VS_IDEAL = 3.0, 0.9
# unique: kv within 5% of pow2 on p99 TTFT and throughput; hot: no more
# shed, p99 TTFT not worse (its throughput is shown, not a goal).
UNIQUE_SLACK = 0.05


def add_parser(sub) -> None:
    p = sub.add_parser("routing", help="every routing policy on the same seeded arrivals: TTFT, hit rate, KV spread")
    p.add_argument(
        "--workers-kind",
        choices=("simulated", "real"),
        default="simulated",
        help="simulated: load_format simulated workers; real: the model on logical GPUs (CPU compute)",
    )
    p.add_argument("--num-workers", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--workloads", default="shared,unique,hot")
    p.add_argument("--duration-s", type=float, default=15.0, help="seconds of arrivals in each run")
    p.add_argument("--warmup-s", type=float, default=4.0, help="arrivals before this are not counted")
    p.add_argument(
        "--sim-speedup",
        type=float,
        default=4.0,
        help="simulated workers: every step takes 1/this of the cost model's time (the same engine, "
        "faster: more requests per minute of the bench, and the router's figures as old, relative "
        "to a step, as on a GPU)",
    )
    p.add_argument("--rates", default=None, help="comma-separated requests/s to run at, skipping the knee")
    p.add_argument(
        "--sweep-rates",
        default=None,
        help="pow2's rates (req/s) on `shared` to find its knee (default: "
        f"{','.join(map(str, SWEEP_PER_WORKER))} req/s per worker, "
        "times --sim-speedup for simulated ones)",
    )
    p.add_argument("--knee-factor", type=float, default=2.0, help="the knee: p99 TTFT above this x the lowest rate's")
    p.add_argument("--resweep", action="store_true", help="find the knee again even if the JSON holds it")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the policies that --output (of the same setup and knee) has in full; run the others",
    )
    p.add_argument(
        "--ttft-target-s",
        type=float,
        default=None,
        help="goodput counts requests with TTFT within this (default: 4 s, over --sim-speedup)",
    )
    p.add_argument(
        "--cache-factor",
        type=float,
        default=4.0,
        help="without --num-kv-blocks: a worker holds 1/this of `shared`'s working set",
    )
    p.add_argument("--token-scale", type=float, default=1.0, help="every prompt and output length times this")
    p.add_argument("--open-chats", type=int, default=None, help="chats open at once (default 32)")
    p.add_argument("--max-waiting", type=int, default=256, help="waiting requests per worker before it sheds")
    p.add_argument(
        "--run-timeout-s",
        type=float,
        default=180.0,
        help="requests still running this long after the last arrival count as failed",
    )
    p.add_argument("--output", default="bench_results/routing.json")
    EngineArgs.add_cli_args(p)  # --seed seeds the workloads too; --num-kv-blocks sizes each worker's cache
    p.set_defaults(func=run)


@dataclass(slots=True)
class Outcome:
    status: str = "failed"  # ok | shed | failed
    sent_s: float = 0.0  # since the run's start
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


# ---- one run: arrivals over HTTP, KV usage sampled beside them ----------------


async def _one(session, url: str, req, out: Outcome, start: float) -> None:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    body = {
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 1.0,
        "seed": req.seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    out.sent_s = t0 - start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status in (429, 503):
                out.status, out.error = "shed", f"HTTP {resp.status}"
                return
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out.error = str(chunk["error"].get("message"))[:200]
                    return
                if chunk.get("choices") and math.isnan(out.ttft):
                    out.ttft = time.perf_counter() - t0
                if usage := chunk.get("usage"):
                    out.output_tokens, out.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.e2e = time.perf_counter() - t0
        out.status, out.error = ("ok", "") if out.output_tokens else ("failed", "the stream ended without tokens")
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"[:200]


@dataclass(slots=True)
class Sample:
    """The workers at one moment."""

    t: float  # seconds since the run's start
    spread: float  # max - min KV usage (used / total blocks)
    usage: float  # mean KV usage
    waiting: int  # requests waiting, all workers
    preemptions: int  # so far, all workers


async def _sample_kv(handle, num_workers: int, start: float, stop: asyncio.Event) -> list[Sample]:
    """Every worker's stats (a broadcast), every KV_SAMPLE_S."""
    samples = []
    while not stop.is_set():
        t = time.perf_counter() - start
        try:
            loads = await handle.broadcast("stats").results_async(timeout_s=2.0, return_exceptions=True)
        except Exception:
            loads = []
        loads = [s for s in loads if not isinstance(s, BaseException) and s.num_total_blocks]
        if len(loads) == num_workers:
            used = [1 - s.num_free_blocks / s.num_total_blocks for s in loads]
            samples.append(
                Sample(
                    t,
                    max(used) - min(used),
                    sum(used) / len(used),
                    sum(s.num_waiting for s in loads),
                    sum(s.num_preemptions for s in loads),
                )
            )
        try:
            await asyncio.wait_for(stop.wait(), KV_SAMPLE_S)
        except TimeoutError:
            pass
    return samples


async def drive(requests, base_url: str, handle, num_workers: int, timeout_s: float):
    """Send every request at its arrival time; returns (outcomes, KV spread samples, seconds)."""
    import aiohttp

    outcomes = [Outcome() for _ in requests]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_kv(handle, num_workers, start, stop))
        url = base_url + "/v1/completions"
        tasks = [asyncio.create_task(_one(session, url, r, o, start)) for r, o in zip(requests, outcomes)]
        last = requests[-1].arrival_s if requests else 0.0
        _, pending = await asyncio.wait(tasks, timeout=last + timeout_s) if tasks else (None, ())
        for t in pending:
            t.cancel()
        for o in outcomes:
            if o.status == "failed" and not o.error:
                o.error = "timed out"
        await asyncio.gather(*pending, return_exceptions=True)
        stop.set()
        samples = await sampler
        return outcomes, samples, time.perf_counter() - start


# ---- figures ----------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile (nan when empty)."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def summarize(requests, outcomes: list[Outcome], samples, warmup_s: float, ttft_target_s: float, ideal: float) -> dict:
    """The reported figures over the requests that arrived after warmup_s."""
    counted = [(r, o) for r, o in zip(requests, outcomes) if r.arrival_s >= warmup_s]
    ok = [o for _, o in counted if o.status == "ok"]
    ttft = [o.ttft for o in ok]
    begin = min((r.arrival_s for r, _ in counted), default=0.0)
    end = max((o.sent_s + o.e2e for o in ok), default=begin)
    window = max(end - begin, 1e-9)
    good = sum(1 for t in ttft if t <= ttft_target_s)
    prompt = sum(o.prompt_tokens for o in ok)
    counted_samples = [s for s in samples if s.t >= warmup_s]
    return {
        "requests": len(counted),
        "completed": len(ok),
        "shed": sum(o.status == "shed" for _, o in counted),
        "failed": sum(o.status == "failed" for _, o in counted),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "e2e_p99_ms": 1e3 * percentile([o.e2e for o in ok], 99),
        "output_throughput": sum(o.output_tokens for o in ok) / window,
        "goodput": good / window,
        "goodput_share": good / len(counted) if counted else math.nan,
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "ideal_hit_rate": ideal,
        "kv_spread": _mean(s.spread for s in counted_samples),
        "kv_usage": _mean(s.usage for s in counted_samples),
        "waiting": _mean(s.waiting for s in counted_samples),
        "kv_samples": len(counted_samples),
        "preemptions": samples[-1].preemptions - samples[0].preemptions if samples else 0,
        "window_s": window,
        "errors": sorted({o.error for _, o in counted if o.status != "ok"})[:3],
    }


# ---- the cluster --------------------------------------------------------------------


class Bench:
    """A local Ray cluster; the app deployed for one policy at a time."""

    def __init__(self, ns, engine: EngineArgs):
        self.ns, self.engine = ns, engine
        self.http_port = 0

    def __enter__(self):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray import serve

        n, cores = self.ns.num_workers, os.cpu_count() or 1
        # "local": a cluster of our own, never one that `ray start` left running here.
        if self.ns.workers_kind == "real":  # one logical GPU each: the engine finds no CUDA and runs on the CPU
            ray.init(address="local", num_cpus=max(cores, n + 1), num_gpus=n, **RAY_QUIET)
        else:
            ray.init(address="local", num_cpus=max(cores, 2), num_gpus=0, **RAY_QUIET)
        serve.start(proxy_location="Disabled", logging_config=QUIET)
        return self

    def __exit__(self, *exc):
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def deploy(self, policy: str):
        from ray import serve

        from shoal.cluster.app import build_app
        from shoal.cluster.options import ServeOptions

        self.http_port = free_port()
        sim = self.ns.workers_kind == "simulated"
        opts = ServeOptions(
            http_port=self.http_port,
            grpc_port=free_port(),
            num_workers=self.ns.num_workers,
            max_waiting=self.ns.max_waiting,
            drain_timeout_s=5.0,
            routing=policy,
            cpus_per_worker=SIM_CPUS_PER_WORKER if sim else 1.0,
            engine=self.engine,
        )
        serve.run(build_app(opts), name=APP, route_prefix=None, logging_config=QUIET)
        return serve.get_deployment_handle("Worker", APP)

    def delete(self) -> None:
        from ray import serve

        serve.delete(APP)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


# ---- the run ---------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str, allowed, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(x not in allowed for x in names):
        raise ValueError(f"--{what} takes a comma-separated subset of {', '.join(allowed)}")
    return names


def _engine_args(ns, cost_path: str) -> EngineArgs:
    """The workers' engine; simulated ones step by the cost model sped up
    --sim-speedup times, written to cost_path."""
    from shoal.workers.model_executor.runner.simulated_runner import load_cost_model

    args = EngineArgs.from_cli_args(ns)
    if ns.workers_kind != "simulated":
        return args
    cost = load_cost_model(args.simulated_cost_model)
    fast = type(cost)(
        *(c / ns.sim_speedup for c in cost.coefficients()),
        source=f"{cost.source or args.simulated_cost_model} / {ns.sim_speedup:g}",
    )
    with open(cost_path, "w") as f:
        json.dump(fast.to_dict(), f)
    return dataclasses.replace(
        args, load_format="simulated", device="cpu", num_threads=args.num_threads or 1, simulated_cost_model=cost_path
    )


def _knee_key(ns, engine: EngineArgs, sizes) -> dict:
    """What the knee depends on: a cached knee is reused only for the same
    (as JSON reads it back: tuples are lists)."""
    key = {
        "workers_kind": ns.workers_kind,
        "num_workers": ns.num_workers,
        "num_kv_blocks": engine.num_kv_blocks,
        "model": engine.model,
        "simulated_cost_model": ns.simulated_cost_model,
        "sim_speedup": ns.sim_speedup,
        "sizes": dataclasses.asdict(sizes),
        "duration_s": ns.duration_s,
        "warmup_s": ns.warmup_s,
        "sweep_rates": _floats(ns.sweep_rates),
        "knee_factor": ns.knee_factor,
        "seed": ns.seed,
    }
    return json.loads(json.dumps(key))


def _cached_knee(report: dict, key: dict) -> dict | None:
    """The knee a report of the same setup found."""
    knee = report.get("knee")
    return knee if knee and knee.get("key") == key and knee.get("rate") else None


def find_knee(sweep: list[dict], factor: float) -> tuple[float, bool]:
    """(the first swept rate whose p99 TTFT exceeds factor x the lowest rate's, whether one did);
    the highest rate when none did."""
    base = sweep[0]["ttft_p99_ms"]
    for s in sweep:
        if s["ttft_p99_ms"] > factor * base:
            return s["rate"], True
    return sweep[-1]["rate"], False


def run(ns) -> int:
    from shoal.benchmarks.routing_workloads import WORKLOADS

    policies = _names(ns.policies, POLICIES, "policies")
    workloads = _names(ns.workloads, WORKLOADS, "workloads")
    if ns.num_workers < 1 or ns.duration_s <= ns.warmup_s:
        raise ValueError("--num-workers must be >= 1 and --duration-s longer than --warmup-s")
    t_start = time.perf_counter()
    speedup = ns.sim_speedup if ns.workers_kind == "simulated" else 1.0
    if ns.ttft_target_s is None:
        ns.ttft_target_s = 4.0 / speedup
    if ns.sweep_rates is None:
        ns.sweep_rates = ",".join(f"{r * ns.num_workers * speedup:.3g}" for r in SWEEP_PER_WORKER)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-routing-") as tmp:
        engine = _engine_args(ns, os.path.join(tmp, "step_cost.json"))
        report = Runs(ns, engine, policies, workloads).all()
    report["seconds"] = time.perf_counter() - t_start
    print_table(report)
    _write_report(ns.output, report)
    svg = os.path.splitext(ns.output)[0] + ".svg"
    with open(svg, "w") as f:
        f.write(grid_plot(report["results"], ns.warmup_s))
    print(f"wrote {ns.output} and {svg}")
    return 0


class Runs:
    """The knee (pow2's sweep, unless given or cached), then every policy on
    every workload at every load."""

    def __init__(self, ns, engine: EngineArgs, policies: list[str], workloads: list[str]):
        from shoal.benchmarks import routing_workloads as wl
        from shoal.workers.model_executor.loader.model_loader import load_model_files

        self.ns, self.wl, self.policies, self.workloads = ns, wl, policies, workloads
        cfg = load_model_files(engine.model).config
        self.vocab = wl.Vocab(cfg.vocab_size, tuple(cfg.eos_token_ids))
        sizes = wl.WorkloadSizes().scaled(ns.token_scale)
        self.sizes = dataclasses.replace(sizes, open_chats=ns.open_chats) if ns.open_chats else sizes
        self.known = ns.workers_kind == "simulated"  # a simulated reply is the one the next turn carries
        self.bs = bs = engine.block_size
        blocks, ws = wl.worker_blocks(self.sizes, self.vocab, bs, ns.cache_factor, ns.seed, self.known)
        self.blocks = engine.num_kv_blocks or blocks
        self.engine = dataclasses.replace(engine, num_kv_blocks=self.blocks)
        cost = None
        if engine.simulated_cost_model and engine.load_format == "simulated":
            with open(engine.simulated_cost_model) as f:
                cost = json.load(f)
        self.setup = {
            "workers_kind": ns.workers_kind,
            "num_workers": ns.num_workers,
            "kv_blocks_per_worker": self.blocks,
            "block_size": bs,
            "shared_working_set_blocks": ws,
            "working_set_per_worker_cache": ws / self.blocks,
            "duration_s": ns.duration_s,
            "warmup_s": ns.warmup_s,
            "ttft_target_s": ns.ttft_target_s,
            "seed": ns.seed,
            "sizes": dataclasses.asdict(self.sizes),
            "model": engine.model or "default",
            "load_format": engine.load_format,
            "step_cost_model": cost,
            "transport": "HTTP /v1/completions, streamed",
        }
        print(
            f"routing bench: {ns.num_workers} {ns.workers_kind} workers of {self.blocks} KV blocks "
            f"({self.blocks * bs} tokens); `shared` working set {ws:.0f} blocks = {ws / self.blocks:.1f}x one "
            f"worker's cache",
            flush=True,
        )

    def one(
        self,
        bench: Bench,
        handle,
        policy: str,
        kind: str,
        label: str,
        rate: float,
        index: int,
        duration_s: float | None = None,
    ):
        """One run: its row of figures."""
        ns, wl = self.ns, self.wl
        seed = ns.seed * 1000 + index  # one seed per (workload, load), the same for every policy
        reqs = wl.make_workload(kind, rate, duration_s or ns.duration_s, seed, self.vocab, self.sizes)
        counted = [i for i, r in enumerate(reqs) if r.arrival_s >= ns.warmup_s]
        outcomes, samples, secs = asyncio.run(drive(reqs, bench.base_url, handle, ns.num_workers, ns.run_timeout_s))
        ideal = wl.ideal_hit_rate(reqs, self.blocks * ns.num_workers, self.bs, self.vocab, self.known, counted)
        row = {
            "workload": kind,
            "load": label,
            "rate": rate,
            "policy": policy,
            **summarize(reqs, outcomes, samples, ns.warmup_s, ns.ttft_target_s, ideal),
        }
        # Each request: arrival s, system prompt, turn, prompt and cached tokens, TTFT and E2E ms, output tokens.
        row["detail"] = [
            [
                round(r.arrival_s, 3),
                r.group,
                r.turn,
                o.prompt_tokens,
                o.cached_tokens,
                round(o.ttft * 1e3, 1),
                round(o.e2e * 1e3, 1),
                o.output_tokens,
                o.status,
            ]
            for r, o in zip(reqs, outcomes)
        ]
        print(
            f"  {policy:<14} {kind:<7} {label:<9} {rate:5.2f}/s: {row['completed']}/{row['requests']} done, "
            f"TTFT p99 {row['ttft_p99_ms'] / 1e3:.2f} s, hit {row['hit_rate']:.2f} (ideal {ideal:.2f}), "
            f"{secs:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        return row

    def sweep(self, bench: Bench, handle, key: dict) -> dict:
        """pow2 on `shared` at rising rates, up to its knee."""
        ns, done = self.ns, []
        for j, rate in enumerate(_floats(ns.sweep_rates)):
            duration = min(max(ns.duration_s, ns.warmup_s + SWEEP_MIN_REQUESTS / rate), 3 * ns.duration_s)
            done.append(self.one(bench, handle, "pow2", "shared", "sweep", rate, 900 + j, duration))
            if find_knee(done, ns.knee_factor)[1]:
                break
        rate, reached = find_knee(done, ns.knee_factor)
        print(
            f"pow2's knee on `shared`: {rate:g} req/s" + ("" if reached else " (not reached: the top rate)"), flush=True
        )
        return {
            "rate": rate,
            "reached": reached,
            "factor": ns.knee_factor,
            "key": key,
            "sweep": [{k: s[k] for k in ("rate", "ttft_p50_ms", "ttft_p99_ms", "hit_rate")} for s in done],
        }

    def all(self) -> dict:
        """Every run; the report is written to --output after each one (a
        crash keeps what was measured) and once more, complete, at the end."""
        ns = self.ns
        key = _knee_key(ns, self.engine, self.sizes)
        prior = _read_report(ns.output)
        knee = None if ns.rates or ns.resweep else _cached_knee(prior, key)
        if knee:
            print(f"knee from {ns.output}: {knee['rate']:g} req/s", flush=True)
        resume = ns.resume and (ns.rates or knee)
        rows = _resumable(prior, key, _loads(ns, knee), self.policies, self.workloads) if resume else []
        done = {r["policy"] for r in rows}
        if done:
            print(f"kept from {ns.output}: {', '.join(sorted(done))}", flush=True)
        todo = [p for p in self.policies if p not in done]
        order = todo if ns.rates or knee else ["pow2", *(p for p in todo if p != "pow2")]
        report = {"setup": self.setup, "key": key, "knee": knee, "results": rows, "complete": False}
        with Bench(ns, self.engine) if order else contextlib.nullcontext() as bench:
            for policy in order:
                t0 = time.perf_counter()
                handle = bench.deploy(policy)
                print(f"{policy}: deployed in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                if not ns.rates and knee is None:
                    knee = report["knee"] = self.sweep(bench, handle, key)
                if policy in todo:
                    for w, kind in enumerate(self.workloads):
                        for j, (label, rate) in enumerate(_loads(ns, knee)):
                            rows.append(self.one(bench, handle, policy, kind, label, rate, 10 * w + j))
                            _write_report(ns.output, report)
                bench.delete()
        labels = [lb for lb, _ in _loads(ns, knee)]
        rows.sort(
            key=lambda r: (
                self.workloads.index(r["workload"]),
                labels.index(r["load"]),
                self.policies.index(r["policy"]),
            )
        )
        report.update(goals=check_goals(rows), complete=True)
        return report


def _loads(ns, knee: dict) -> list[tuple[str, float]]:
    """(label, requests/s) of every load: --rates, or 75% of the knee and the knee."""
    if ns.rates:
        return [(f"{r:g}/s", r) for r in _floats(ns.rates)]
    return [("75% knee", 0.75 * knee["rate"]), ("knee", knee["rate"])]


def _read_report(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_report(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def _resumable(prior: dict, key: dict, loads, policies, workloads) -> list[dict]:
    """The rows of every policy that a report of the same setup has in full
    at these loads (for --resume, after a run that stopped half way)."""
    if prior.get("key") != key:
        return []
    want = {(w, label, rate) for w in workloads for label, rate in loads}
    rows = [r for r in prior.get("results", []) if (r["workload"], r["load"], r["rate"]) in want]
    have = {p: {(r["workload"], r["load"], r["rate"]) for r in rows if r["policy"] == p} for p in policies}
    keep = {p for p in policies if len(have[p]) == len(want)}
    return [r for r in rows if r["policy"] in keep]


# ---- goals, table, plot ----------------------------------------------------------------


def check_goals(rows: list[dict]) -> list[dict]:
    """kv against pow2: the goals on `shared`, the guardrails on `unique` and
    `hot` ("ok" None: shown for the record, not a goal)."""
    at = {(r["workload"], r["load"], r["policy"]): r for r in rows}
    out = []

    def goal(name, value, target, ok):
        out.append({"goal": name, "value": value, "target": target, "ok": None if ok is None else bool(ok)})

    for (kind, label, policy), kv in at.items():
        pow2 = at.get((kind, label, "pow2"))
        if policy != "kv" or pow2 is None:
            continue
        slower = kv["ttft_p99_ms"] / pow2["ttft_p99_ms"] if pow2["ttft_p99_ms"] > 0 else math.inf
        tput = kv["output_throughput"] / pow2["output_throughput"] if pow2["output_throughput"] else math.nan
        where = f"{kind} @ {label}"
        if kind == "shared":
            want = GOALS.get(label)
            if want:
                goal(f"{where}: pow2 p99 TTFT / kv's", 1 / slower, f">= {want:g}", 1 / slower >= want)
            hit = kv["hit_rate"] / pow2["hit_rate"] if pow2["hit_rate"] else math.inf
            goal(f"{where}: kv hit rate / pow2's", hit, f">= {HIT_VS_POW2:g}", hit >= HIT_VS_POW2)
            ideal = kv["hit_rate"] / kv["ideal_hit_rate"] if kv["ideal_hit_rate"] else math.nan
            goal(f"{where}: kv hit rate / ideal", ideal, f">= {HIT_VS_IDEAL:g}", ideal >= HIT_VS_IDEAL)
            goal(f"{where}: kv throughput / pow2's", tput, ">= 1", tput >= 1.0)
        elif kind == "unique":
            goal(f"{where}: kv p99 TTFT / pow2's", slower, f"<= {1 + UNIQUE_SLACK:g}", slower <= 1 + UNIQUE_SLACK)
            goal(f"{where}: kv throughput / pow2's", tput, f">= {1 - UNIQUE_SLACK:g}", tput >= 1 - UNIQUE_SLACK)
        else:
            shed = kv.get("shed", 0) - pow2.get("shed", 0)
            goal(f"{where}: kv shed - pow2's", shed, "<= 0", shed <= 0)
            goal(f"{where}: kv p99 TTFT / pow2's", slower, "<= 1", slower <= 1.0)
            goal(f"{where}: kv throughput / pow2's", tput, "(shown)", None)
    return out


COLUMNS = (
    ("workload", "{:<8}", "workload"),
    ("load", "{:<9}", "load"),
    ("rate", "{:>6.2f}", "req/s"),
    ("policy", "{:<14}", "policy"),
    ("counts", "{:>12}", "ok/shed/fail"),
    ("ttft_p50_ms", "{:>9.0f}", "TTFT p50"),
    ("ttft_p99_ms", "{:>9.0f}", "TTFT p99"),
    ("e2e_p99_ms", "{:>9.0f}", "E2E p99"),
    ("output_throughput", "{:>8.1f}", "out tok/s"),
    ("goodput", "{:>14}", "goodput req/s"),
    ("hit_rate", "{:>5.2f}", "hit"),
    ("ideal_hit_rate", "{:>5.2f}", "ideal"),
    ("kv_spread", "{:>9.2f}", "KV spread"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    if key == "counts":
        return fmt.format(f"{row['completed']}/{row['shed']}/{row['failed']}")
    if key == "goodput":
        return fmt.format(f"{row['goodput']:.2f} ({100 * row['goodput_share']:.0f}%)")
    return fmt.format(row[key])


def print_table(report: dict) -> None:
    setup, knee, rows, goals = report["setup"], report["knee"], report["results"], report["goals"]
    widths = [len(_cell(rows[0], k, f)) if rows else len(h) for k, f, h in COLUMNS]
    widths = [max(w, len(h)) for w, (_, _, h) in zip(widths, COLUMNS)]
    print(
        f"\n{setup['num_workers']} {setup['workers_kind']} workers, {setup['kv_blocks_per_worker']} KV blocks each; "
        f"`shared` working set {setup['working_set_per_worker_cache']:.1f}x one worker's cache; "
        f"{setup['duration_s']:g} s of arrivals per run, the first {setup['warmup_s']:g} s not counted; "
        f"goodput: TTFT <= {setup['ttft_target_s']:g} s; times in ms"
    )
    if knee:
        sweep = ", ".join(f"{s['rate']:g}/s {s['ttft_p99_ms'] / 1e3:.1f} s" for s in knee.get("sweep", []))
        print(
            f"knee: {knee['rate']:g} req/s, where pow2's p99 TTFT on `shared` first exceeds {knee['factor']:g}x "
            f"the lowest rate's" + (f" (sweep, p99 TTFT: {sweep})" if sweep else "")
        )
    print("  ".join(h.rjust(w) for (_, _, h), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(_cell(r, k, f).rjust(w) for (k, f, _), w in zip(COLUMNS, widths)))
    for g in goals:
        print(
            f"{({True: 'PASS', False: 'FAIL'}).get(g['ok'], 'INFO')}  {g['goal']}: {g['value']:.2f} "
            f"(target {g['target']})"
        )
    print(f"{len(rows)} runs in {report['seconds'] / 60:.1f} min")


def grid_plot(rows: list[dict], warmup_s: float, panel_w: int = 480, panel_h: int = 320) -> str:
    """One TTFT CDF panel per (workload, load), a line per policy, in a grid
    (a row per workload), over each run's counted requests."""
    cdfs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in rows:
        cdfs.setdefault((r["workload"], r["load"]), {})[r["policy"]] = [
            d[5] for d in r["detail"] if d[0] >= warmup_s and d[-1] == "ok"
        ]
    kinds = list(dict.fromkeys(k for k, _ in cdfs))
    labels = list(dict.fromkeys(lb for _, lb in cdfs))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel_w * max(1, len(labels))}" '
        f'height="{panel_h * max(1, len(kinds))}">'
    ]
    for (kind, label), series in cdfs.items():
        x, y = panel_w * labels.index(label), panel_h * kinds.index(kind)
        panel = cdf_plot(series, f"TTFT CDF: {kind} @ {label}", "ms", panel_w, panel_h)
        parts.append(panel.replace("<svg ", f'<svg x="{x}" y="{y}" ', 1))
    parts.append("</svg>")
    return "\n".join(parts)
