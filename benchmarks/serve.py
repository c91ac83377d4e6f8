"""`shoal bench serve`: online serving latency and throughput, defined like
`vllm bench serve`.

A seeded workload (prompts of random common words, fixed output lengths with
ignore_eos), Poisson arrivals at --request-rate (inf: all at once), streamed.
With --url (any OpenAI-compatible server) or --grpc it measures that target.
Without either it measures the cluster's own cost in one run: the same
workload offered to an in-process AsyncEngine, then to a served cluster over
HTTP and over gRPC, side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import statistics
import time

from shoal.benchmarks.load_generator import Result, http_sender, offer, salted
from shoal.benchmarks.ports import free_port
from shoal.benchmarks.svg_plot import cdf_plot
from shoal.workers.engine_args import EngineArgs

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


def random_words(rng: random.Random, n: int) -> str:
    """A prompt of n common English words (about n tokens), drawn from rng."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="online latency/throughput: in-process vs the served cluster (HTTP, gRPC)")
    p.add_argument(
        "--url", default=None, help="measure this OpenAI-compatible base URL only (e.g. http://host:8000/v1)"
    )
    p.add_argument("--grpc", default=None, help="measure this shoal gRPC address only (host:port)")
    p.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"))
    p.add_argument("--served-model", default=None, help="model name to send with --url")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="words per prompt (about one token each)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf = all at once")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="alternate in-process / HTTP / gRPC this many times")
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also a second cluster with OpenTelemetry tracing on (exporting every span to a sink in this "
        "process), offered the same work in each round: what tracing costs",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="vllm (or none): also `vllm serve` (vLLM's CPU build, installed on first use) on the same model, "
        "offered the same work after shoal's cluster, each a column",
    )
    p.add_argument(
        "--vllm-dtype",
        default=None,
        help="--peers vllm: the dtype vllm serve runs in (default: bfloat16 where the CPU computes it, else float32)",
    )
    p.add_argument(
        "--vllm-bench-serve",
        type=int,
        metavar="CONCURRENCY",
        help="--peers vllm: also `vllm bench serve` at this max concurrency against shoal's cluster and vllm serve "
        "(its random dataset: --input-len tokens in, --output-len out, --num-prompts)",
    )
    p.add_argument("--output", default="bench_results/serve.json")
    EngineArgs.add_cli_args(p)  # its --seed seeds the workload too
    p.set_defaults(func=run)


def chosen_peers(ns) -> list[str]:
    peers = [p for p in (ns.peers or "").split(",") if p and p != "none"]
    if set(peers) - {"vllm"}:
        raise ValueError(f"--peers takes vllm or none; got {ns.peers!r}")
    if peers and (ns.url or ns.grpc):
        raise ValueError("--peers compares against shoal's own cluster: not with --url or --grpc")
    if ns.vllm_bench_serve is not None and (not peers or ns.vllm_bench_serve < 1):
        raise ValueError("--vllm-bench-serve takes a concurrency of 1 or more, with --peers vllm")
    return peers


def replica_cpu_s(app: str) -> dict[str, float]:
    """CPU seconds the app's replica processes have used so far, summed by
    deployment (Router, Worker), each read in its own process (tensor-parallel
    ranks beyond the replica are not counted)."""
    import ray

    refs: dict[str, list] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{app}#"):
            actor = ray.get_actor(a["name"], namespace="serve")
            refs.setdefault(a["name"].split("#")[1], []).append(
                actor.__ray_call__.remote(lambda _: time.process_time())
            )
    return {kind: sum(ray.get(r, timeout=30)) for kind, r in refs.items()}


class CpuMeter:
    """CPU seconds used while one target ran: this process (the client, and
    for the in-process target the engine too) and, for our own cluster, its
    router and worker processes. Read between targets, when nothing is in flight."""

    def __init__(self, app: str | None = None):
        self.app = app

    def read(self) -> dict[str, float]:
        out = {"this process": time.process_time()}
        if self.app is not None:
            out.update(replica_cpu_s(self.app))
        return out

    async def around(self, offer):
        """(results, duration, {process: CPU s}) of awaiting `offer`."""
        before = self.read()
        res, dur = await offer
        after = self.read()
        return res, dur, {k: after[k] - before.get(k, 0.0) for k in after}


def make_workload(n: int, input_len: int, output_len: int, rate: float, seed: int):
    """[(arrival offset s, prompt text, max_tokens)], the same for every target."""
    rng = random.Random(seed)
    t, work = 0.0, []
    for _ in range(n):
        work.append((t, random_words(rng, input_len), output_len))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return work


def in_process_sender(engine):
    import itertools

    from shoal.proto.messages import GenerateRequest
    from shoal.workers import SamplingParams

    ids = itertools.count()

    async def send(prompt, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerateRequest(f"bench-{next(ids)}", engine.engine.tokenize(prompt), params)
        async for out in engine.generate(request):
            yield len(out.new_token_ids), out.num_prompt_tokens, None

    return send


def grpc_sender(stub, api_key: str | None):
    from shoal.proto.v1 import shoal_pb2 as pb

    md = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def send(prompt, max_tokens):
        req = pb.GenerateRequest(
            text=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        async for msg in stub.Generate(req, metadata=md):
            yield len(msg.token_ids), msg.finished.usage.prompt_tokens, None

    return send


def summarize(label: str, results: list[Result], duration: float, cpu: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    # CPU per output token, by process: what serving each token costs the machine.
    cpu_ms = {proc: 1000 * secs / out_tokens for proc, secs in (cpu or {}).items()} if out_tokens else {}

    def pct(xs, q):
        if not xs:
            return float("nan")
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]

    def stats(xs):
        xs = [x * 1000 for x in xs]
        return {"mean": statistics.fmean(xs) if xs else float("nan"), "p50": pct(xs, 50), "p99": pct(xs, 99)}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "label": label,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "e2el_ms": stats([r.e2e for r in ok]),
        "cpu_ms_per_output_token": cpu_ms,
        # CPU use while it ran, by process: 100 = one core busy the whole time.
        "cpu_percent": {proc: 100 * secs / duration for proc, secs in (cpu or {}).items()} if duration else {},
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


_PROCS = ["this process", "Router", "Worker"]


def print_table(rows: list[dict]) -> None:
    cols = [r["label"] for r in rows]
    width = max(12, *(len(c) for c in cols)) + 2
    print(f"{'':32}" + "".join(f"{c:>{width}}" for c in cols))

    def line(name, get, fmt="{:.1f}"):
        print(f"{name:32}" + "".join(f"{fmt.format(get(r)):>{width}}" for r in rows))

    line("completed / failed", lambda r: f"{r['completed']}/{r['failed']}", "{}")
    line("duration (s)", lambda r: r["duration_s"], "{:.2f}")
    line("request throughput (req/s)", lambda r: r["request_throughput"], "{:.2f}")
    line("output throughput (tok/s)", lambda r: r["output_throughput"])
    line("total token throughput (tok/s)", lambda r: r["total_token_throughput"])
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        for stat in ("mean", "p50", "p99"):
            line(f"{name} {stat} (ms)", lambda r, k=key, s=stat: r[k][s])
    for proc in sorted(
        {p for r in rows for p in r.get("cpu_ms_per_output_token", {})},
        key=lambda p: (_PROCS.index(p) if p in _PROCS else len(_PROCS), p),
    ):
        line(f"CPU ms/token: {proc}", lambda r, p=proc: r["cpu_ms_per_output_token"].get(p, float("nan")), "{:.2f}")
    if any(r.get("cpu_ms_per_output_token") for r in rows):
        line("CPU ms/token: all", lambda r: sum(r.get("cpu_ms_per_output_token", {}).values()), "{:.2f}")
    # The engine's process: this one in-process (the load generator too), the Worker replica when served.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if any(r.get("cpu_percent") for r in rows):

        def engine_pct(r):
            pct = r.get("cpu_percent", {})
            proc = "this process" if r["label"].startswith("in-process") else "Worker"
            return pct.get(proc, float("nan"))

        line("worker CPU (% of one core)", engine_pct, "{:.0f}")
        line(f"worker CPU (% of {cores} cores)", lambda r: engine_pct(r) / cores, "{:.0f}")
    base = rows[0]
    for r in rows[1:]:
        print(
            f"{r['label']} vs {base['label']}: TTFT p50 {r['ttft_ms']['p50'] - base['ttft_ms']['p50']:+.1f} ms, "
            f"TPOT p50 {100 * (r['tpot_ms']['p50'] / base['tpot_ms']['p50'] - 1):+.1f}%, "
            f"output throughput {100 * r['output_throughput'] / base['output_throughput']:.1f}%"
        )
    by_label = {r["label"]: r for r in rows}
    for r in rows:  # --tracing: what tracing costs, against the same front untraced
        if r["label"].endswith(" traced") and (u := by_label.get(r["label"].removesuffix(" traced"))):
            cpu = lambda x: sum(x.get("cpu_ms_per_output_token", {}).values())  # noqa: E731
            print(
                f"{r['label']} vs untraced: output throughput {100 * (r['output_throughput'] / u['output_throughput'] - 1):+.1f}%, "
                f"TTFT p50 {r['ttft_ms']['p50'] - u['ttft_ms']['p50']:+.1f} ms, "
                f"TPOT p50 {100 * (r['tpot_ms']['p50'] / u['tpot_ms']['p50'] - 1):+.1f}%"
                + (f", CPU per token {100 * (cpu(r) / cpu(u) - 1):+.1f}%" if cpu(u) else "")
            )


async def _measure_cluster(
    ns, opts, work, salts=("", ""), meter: CpuMeter | None = None, suffix: str = ""
) -> list[tuple]:
    """[(label, results, duration, CPU s by process)] for HTTP then gRPC."""
    import aiohttp
    import grpc

    from shoal.proto.v1 import shoal_pb2_grpc

    meter = meter or CpuMeter()
    out = []
    if ns.url or not ns.grpc:
        url = ns.url or f"http://127.0.0.1:{opts.http_port}/v1"
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            send = http_sender(session, url, ns.served_model, ns.api_key)
            out.append(
                (
                    "cluster HTTP" + suffix if not ns.url else url,
                    *await meter.around(offer(salted(work, salts[0]), send, "HTTP" + suffix)),
                )
            )
    if ns.grpc or not ns.url:
        addr = ns.grpc or f"127.0.0.1:{opts.grpc_port}"
        async with grpc.aio.insecure_channel(addr) as ch:
            send = grpc_sender(shoal_pb2_grpc.ShoalStub(ch), ns.api_key)
            out.append(
                (
                    "cluster gRPC" + suffix if not ns.grpc else addr,
                    *await meter.around(offer(salted(work, salts[1]), send, "gRPC" + suffix)),
                )
            )
    return out


def _compare(ns, work, after=None) -> list[tuple[str, list[Result], float]]:
    """The cluster is started first and left idle while the in-process engine
    runs, then the targets alternate for --rounds rounds (each round with its
    own prompt prefix), so that drift in the machine's speed hits all alike.
    after(opts), if given, runs against the cluster before it is shut down."""
    from shoal.cluster.options import ServeOptions
    from shoal.cluster.serve_cmd import APP_NAME, launch, shut_down
    from shoal.workers import AsyncEngine

    opts = ServeOptions(
        http_port=free_port(),
        grpc_port=free_port(),
        num_workers=ns.num_workers,
        api_key=ns.api_key,
        engine=EngineArgs.from_cli_args(ns),
    )
    # Every prompt may wait at once: the bench measures latency, not refusals.
    opts = dataclasses.replace(opts, max_waiting=max(opts.max_waiting, ns.num_prompts))
    # The in-process engine gets what one worker gets: same engine, same threads.
    local_args = opts.worker_engine_args(gpu=opts.uses_gpu())
    launch(opts)
    traced, sink = _launch_traced(opts) if ns.tracing else (None, None)
    try:

        async def main():
            eng = AsyncEngine.from_engine_args(local_args)
            send = in_process_sender(eng)
            meter = CpuMeter(APP_NAME)
            traced_meter = CpuMeter(TRACED_APP) if traced is not None else None
            await offer(salted(work[:4], "warm"), send, "warm-up")
            await _measure_cluster(ns, opts, work[:4], ("warm", "warm2"))
            if traced is not None:
                await _measure_cluster(ns, traced, work[:4], ("twarm", "twarm2"))
            got: dict[str, list] = {}
            for k in range(ns.rounds):
                local = await meter.around(offer(salted(work, f"local{k}"), send, f"in-process {k + 1}/{ns.rounds}"))
                rounds = [("in-process", *local)]
                rounds += await _measure_cluster(ns, opts, work, (f"http{k}", f"grpc{k}"), meter)
                if traced is not None:
                    rounds += await _measure_cluster(
                        ns, traced, work, (f"thttp{k}", f"tgrpc{k}"), traced_meter, " traced"
                    )
                for label, res, dur, cpu in rounds:
                    acc = got.setdefault(label, [label, [], 0.0, {}])
                    acc[1] += res
                    acc[2] += dur
                    for proc, secs in cpu.items():
                        acc[3][proc] = acc[3].get(proc, 0.0) + secs
            await eng.shutdown()
            return [tuple(v) for v in got.values()]

        out = asyncio.run(main())
        if after is not None:
            after(opts)
        if sink is not None:
            print(f"the traced cluster exported {sink.num_spans} spans")
        return out
    finally:
        if sink is not None:
            from ray import serve

            serve.delete(TRACED_APP)
            sink.__exit__()
        shut_down()


TRACED_APP = "shoal-traced"


def _launch_traced(opts):
    """A second application like the first, on its own ports, with tracing
    on: every replica exports its spans to a sink here (OTEL_* variables of
    this process, which build_app hands to the replicas)."""
    from ray import serve

    from shoal.benchmarks.otlp_sink import OtlpSink
    from shoal.cluster.app import build_app

    sink = OtlpSink().__enter__()
    traced = dataclasses.replace(opts, http_port=free_port(), grpc_port=free_port())
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "shoal-bench"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        serve.run(build_app(traced), name=TRACED_APP, route_prefix=None)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return traced, sink


def run(ns) -> int:
    from shoal.benchmarks import vllm_peer

    peers = chosen_peers(ns)
    vllm_dtype = vllm_peer.parse_dtype(ns.vllm_dtype or vllm_peer.best_dtype()) if peers else None
    work = make_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.request_rate, ns.seed)
    log_dir, bench_rows = os.path.dirname(ns.output) or ".", []
    if ns.url or ns.grpc:
        measured = asyncio.run(_measure_cluster(ns, None, work))
    elif ns.vllm_bench_serve and peers:  # vLLM's load generator against our cluster too, while it is up
        from shoal.benchmarks import vllm_server

        url = "http://127.0.0.1:{}"
        measured = _compare(
            ns,
            work,
            lambda o: bench_rows.append(
                vllm_server.run_bench_serve(url.format(o.http_port), "shoal serve", ns, log_dir)
            ),
        )
    else:
        measured = _compare(ns, work)
    if "vllm" in peers:  # after shoal's cluster is down: one server on the cores at a time
        from shoal.benchmarks import vllm_server

        measured.append(vllm_server.measure(ns, work, vllm_dtype, log_dir, bench_rows))
    rows = [summarize(label, res, dur, cpu) for label, res, dur, cpu in measured]
    print(
        f"workload: {ns.num_prompts} requests, {ns.input_len} words in, {ns.output_len} tokens out, "
        f"rate {ns.request_rate} req/s, seed {ns.seed}, {ns.rounds} round(s) per target"
    )
    print_table(rows)
    if bench_rows:
        from shoal.benchmarks.vllm_server import print_bench_serve

        print_bench_serve(bench_rows, ns.vllm_bench_serve)
    report = {
        "workload": {
            k: getattr(ns, k)
            for k in (
                "num_prompts",
                "input_len",
                "output_len",
                "request_rate",
                "seed",
                "num_workers",
                "rounds",
                "tracing",
                "peers",
            )
        },
        "results": rows,
    }
    if bench_rows:
        report["vllm_bench_serve"] = {"max_concurrency": ns.vllm_bench_serve, "results": bench_rows}
    if ns.tracing and not (ns.url or ns.grpc):
        from shoal.benchmarks.trace_cost import cpu_us_per_request

        us = report["span_cpu_us_per_request"] = cpu_us_per_request()
        print(
            f"one request's spans (router, prepare, route, worker), exported: {us:.0f} us of CPU, "
            f"{us / ns.output_len:.1f} us per output token at --output-len {ns.output_len}"
        )
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    svg = os.path.splitext(ns.output)[0] + ".svg"
    with open(svg, "w") as f:
        f.write(
            cdf_plot(
                {label: [r.ttft * 1000 for r in res if r.ok] for label, res, *_ in measured},
                "Time to first token (CDF)",
                "ms",
            )
        )
    print(f"wrote {ns.output} and {svg}")
    return 0
