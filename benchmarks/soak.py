"""`shoal bench soak`: does memory stay flat under steady load?

Starts `shoal serve` (one worker by default) as a subprocess on loopback,
offers completions at a fixed --rate for --duration seconds (an open loop:
a request is started on every tick unless --max-concurrency are already in
flight, and the loop ends by itself), and samples the RSS of every process
under the serve command (the driver, Ray's daemons, the Serve controller,
the Router and Worker replicas) every --sample-every seconds. Writes a JSON
report and an SVG plot, and prints per process the RSS at --baseline-s
(minute 2: past warm-up and the first high-water marks) and at the end:
PASS when no process grew by more than --max-growth-mb in between.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from shoal.benchmarks.hostile import hostile_request
from shoal.benchmarks.ports import free_port
from shoal.benchmarks.serve import random_words

MB = 1 << 20


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="steady load against `shoal serve`: answers by code, KV blocks, each process's RSS")
    p.add_argument("--rate", type=float, default=12.0, help="requests started per second (fixed interval)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=1024,
        help="requests in flight at most (a tick past it is skipped); above the server's own bound, so "
        "that its 429s are exercised",
    )
    p.add_argument("--input-len", type=int, default=64, help="words per prompt (about one token each)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="seconds a request may take; past it the client hangs up (counted as an error), so the "
        "run ends at most this long after its last request starts",
    )
    p.add_argument(
        "--abort-every",
        type=int,
        default=10,
        help="every Nth request streams and hangs up after its first chunk (0: none)",
    )
    p.add_argument(
        "--hostile-fraction",
        type=float,
        default=0.0,
        help="with F > 0: two phases of --duration each, the first honest only, the second with every "
        "(1/F)th request drawn from the hostile mix (benchmarks/hostile.py); the honest requests stream and "
        "their TTFT is reported for both phases",
    )
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--baseline-s", type=float, default=120.0, help="growth is measured from this time to the end")
    p.add_argument("--max-growth-mb", type=float, default=50.0, help="PASS when every process grew less than this")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--serve-args", default="", help="more `shoal serve` flags, one string (e.g. '--model X')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench_results/soak.json", help="the JSON report; the plot goes beside it")
    p.set_defaults(func=run)


# ---- the processes ----------------------------------------------------------


def role(cmdline: list[str]) -> str:
    """A process's name in the report: a Ray worker by its title
    ("ray::ServeReplica:shoal:Worker.generate" -> "ServeReplica:shoal:Worker"),
    a script by its file, anything else by its program."""
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith("ray::"):
        return first[5:].split(" ")[0].split(".")[0] or "ray worker"
    if "cli" in " ".join(cmdline[1:3]) and "serve" in cmdline:
        return "shoal serve"
    for arg in cmdline[1:]:
        if arg.endswith(".py"):
            return os.path.basename(arg)
    return os.path.basename(first)


@dataclass(slots=True)
class Proc:
    pid: int
    role: str
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)


class RssSampler:
    """The RSS of `root` and of every process under it, sampled on demand."""

    def __init__(self, root: int):
        self.root = root
        self.procs: dict[int, Proc] = {}

    def sample(self, t: float) -> None:
        import psutil

        try:
            top = psutil.Process(self.root)
            tree = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in tree:
            try:
                rss = p.memory_info().rss
                if p.pid not in self.procs:
                    self.procs[p.pid] = Proc(p.pid, role(p.cmdline()))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.procs[p.pid].rss.append((t, rss))


def growth_rows(procs: list[Proc], baseline_s: float, limit_mb: float, window_s: float = 120.0) -> list[dict]:
    """Per process: RSS at the first sample at or after baseline_s (or its
    first sample, when it started later), at its last sample, and the growth;
    and the growth of its peak: the highest sample of the last window_s less
    the highest of the window_s after the baseline. A step's own buffers come
    and go between samples; a peak that keeps rising is memory kept."""
    rows = []
    for p in sorted(procs, key=lambda p: (-max((r for _, r in p.rss), default=0), p.pid)):
        if not p.rss:
            continue
        base = next(((t, r) for t, r in p.rss if t >= baseline_s), p.rss[-1])
        end = p.rss[-1]
        growth = (end[1] - base[1]) / MB
        first = max(r for t, r in p.rss if base[0] <= t <= base[0] + window_s)
        last = max(r for t, r in p.rss if t >= max(base[0], end[0] - window_s))
        peak_growth = (last - first) / MB
        rows.append(
            {
                "pid": p.pid,
                "role": p.role,
                "baseline_t_s": base[0],
                "baseline_mb": base[1] / MB,
                "end_t_s": end[0],
                "end_mb": end[1] / MB,
                "peak_mb": max(r for _, r in p.rss) / MB,
                "growth_mb": growth,
                "peak_growth_mb": peak_growth,
                "ok": growth < limit_mb and peak_growth < limit_mb,
            }
        )
    return rows


# ---- the load ---------------------------------------------------------------


@dataclass(slots=True)
class LoadResult:
    started: int = 0
    skipped: int = 0  # ticks that found --max-concurrency requests in flight
    codes: Counter = field(default_factory=Counter)  # "200", "429", "aborted" (hung up on purpose), "error: ..."
    hostile: Counter = field(default_factory=Counter)  # the hostile mix's answers, "<kind>: <code>"
    ttft_s: list[float] = field(default_factory=list)  # honest streamed requests answered 200


async def offer_load(
    base_url: str,
    rate: float,
    duration: float,
    max_concurrency: int,
    body,
    abort_every: int = 0,
    on_tick=None,
    request_timeout: float = 120.0,
    hostile=None,
    hostile_every: int = 0,
    measure_ttft: bool = False,
) -> LoadResult:
    """Start body(k) at start + k / rate for every k with k / rate < duration.
    Every abort_every-th request streams and closes after its first chunk;
    every hostile_every-th is hostile(k) instead (benchmarks/hostile.py).
    measure_ttft: the honest requests stream, and their time to the first
    chunk is kept. Returns once every started request has ended."""
    import aiohttp

    from shoal.benchmarks.hostile import send_hostile

    out = LoadResult()
    in_flight: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=request_timeout)

    async def one(session, k):
        if hostile is not None and hostile_every > 0 and k % hostile_every == hostile_every - 1:
            try:
                out.hostile[await send_hostile(session, base_url, hostile(k))] += 1
            except Exception as e:
                out.hostile[f"error: {type(e).__name__}"] += 1
            return
        req = body(k)
        abort = abort_every > 0 and k % abort_every == abort_every - 1
        if abort or measure_ttft:
            req = {**req, "stream": True}
        try:
            t0 = time.perf_counter()
            async with session.post(base_url + "/completions", json=req) as resp:
                if abort and resp.status == 200:
                    await resp.content.readline()  # the first chunk, then hang up
                    resp.close()
                    out.codes["aborted"] += 1
                    return
                if measure_ttft and resp.status == 200:
                    await resp.content.readline()
                    ttft = time.perf_counter() - t0
                    await resp.read()
                    out.ttft_s.append(ttft)
                else:
                    await resp.read()
                out.codes[str(resp.status)] += 1
        except Exception as e:  # a refused connection, a reset: counted by kind
            out.codes[f"error: {type(e).__name__}"] += 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        n = int(duration * rate - 1e-9) + 1 if duration > 0 else 0
        for k in range(n):
            await asyncio.sleep(max(0.0, start + k / rate - time.perf_counter()))
            if on_tick is not None:
                on_tick(time.perf_counter() - start)
            if len(in_flight) >= max_concurrency:
                out.skipped += 1
                continue
            task = asyncio.create_task(one(session, k))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            out.started += 1
        if in_flight:
            await asyncio.gather(*in_flight)
    return out


def make_body(seed: int, input_len: int, output_len: int):
    """body(k): the k-th request, the same for a seed: prompts of random words
    (rarely sharing blocks), greedy and sampled in turn."""

    def body(k: int) -> dict:
        rng = random.Random(seed * 1_000_003 + k)
        prompt = random_words(rng, input_len)
        return {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0 if k % 2 else 0.8, "seed": k}

    return body


# ---- the server -------------------------------------------------------------


class ServeProcess:
    """`shoal serve` in a subprocess; stop() ends it and everything under it."""

    def __init__(self, cmd: list[str], ready_timeout_s: float = 600.0):
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(ready_timeout_s):
            self.stop()
            raise RuntimeError("shoal serve did not become ready:\n" + "".join(self.lines[-40:]))

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "; Ctrl-C stops" in line:
                self.ready.set()
        self.ready.set()  # it exited: stop waiting

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGINT (drain, stop Ray), then SIGKILL for whatever of its tree is left."""
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Left over (Ray's workers exit with their raylet): only processes this command started.
        for signal_them in ("terminate", "kill"):
            alive = [p for p in tree if _alive(p)]
            for p in alive:
                try:
                    getattr(p, signal_them)()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=5)
        return self.proc.returncode


def _alive(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def serve_command(ns, http_port: int, grpc_port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shoal.cluster.cli",
        "serve",
        "--num-workers",
        str(ns.num_workers),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        *shlex.split(ns.serve_args),
    ]


def kv_blocks(base: str, wait_s: float = 30.0) -> list[dict]:
    """Each worker's free and total KV blocks from /api/status, once nothing
    runs or waits (or after wait_s)."""
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        workers = httpx.get(base + "/api/status", timeout=10).json()["workers"]
        if all(w["num_running"] == 0 and w["num_waiting"] == 0 for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return [
        {
            "worker": w["worker"],
            "num_free_blocks": w["num_free_blocks"],
            "num_total_blocks": w["num_total_blocks"],
            "num_running": w["num_running"],
        }
        for w in workers
    ]


# ---- the report -------------------------------------------------------------


def rss_plot(procs: list[Proc], title: str, width: int = 720, height: int = 420) -> str:
    """An SVG line per process (the largest first): RSS (MB) over time (s)."""
    from shoal.benchmarks.svg_plot import line_plot

    shown = sorted(procs, key=lambda p: -max((r for _, r in p.rss), default=0))
    series = {f"{p.role} ({p.pid})": [(t, r / MB) for t, r in p.rss] for p in shown}
    return line_plot(series, title, "seconds", "RSS (MB)", width, height, legend_right=170)


def ttft_stats(ttft_s: list[float]) -> dict:
    xs = sorted(ttft_s)

    def pct(q):
        return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)

    return {"n": len(xs), "p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99), "max": round(1000 * xs[-1], 1)}


def print_report(report: dict) -> None:
    w = report["workload"]
    print(
        f"soak: {w['rate']:g} req/s for {w['duration']:g} s, {report['started']} started, "
        f"{report['skipped']} skipped (at --max-concurrency {w['max_concurrency']})"
    )
    print("answers: " + ", ".join(f"{code}: {n}" for code, n in sorted(report["codes"].items())))
    if report.get("hostile_codes"):
        print("hostile: " + ", ".join(f"{code}: {n}" for code, n in sorted(report["hostile_codes"].items())))
    for name, t in report.get("ttft_ms", {}).items():
        print(f"honest TTFT ({name}): n {t['n']}, p50 {t['p50']} ms, p90 {t['p90']} ms, p99 {t['p99']} ms")
    t = report.get("ttft_ms", {})
    if "clean" in t and "hostile" in t:
        print(
            f"honest p99 TTFT with the hostile mix / without: {t['hostile']['p99'] / max(t['clean']['p99'], 1e-9):.2f}x"
        )
    for kv in report["kv_blocks"]:
        print(f"KV blocks after: {kv['worker']}: {kv['num_free_blocks']} free of {kv['num_total_blocks']}")
    base = report["baseline_s"]
    print(
        f"{'process':36}{'pid':>8}{f'RSS@{base:g}s MB':>14}{'end MB':>10}{'peak MB':>10}{'growth MB':>11}"
        f"{'peak growth':>13}"
    )
    for r in report["processes"]:
        print(
            f"{r['role'][:35]:36}{r['pid']:>8}{r['baseline_mb']:>14.1f}{r['end_mb']:>10.1f}{r['peak_mb']:>10.1f}"
            f"{r['growth_mb']:>+11.1f}{r['peak_growth_mb']:>+13.1f}{'' if r['ok'] else '  <- over'}"
        )
    verdict = "PASS" if report["pass"] else "FAIL"
    print(
        f"{verdict}: every process grew less than {w['max_growth_mb']:g} MB between {base:g} s and the end "
        "(its RSS and its peak)"
        if report["pass"]
        else f"{verdict}: some process grew {w['max_growth_mb']:g} MB or more after {base:g} s"
    )


def soak(ns, base_url: str, status_base: str, root_pid: int) -> dict:
    """Offer the load to a running server, sampling the RSS of root_pid's tree."""
    sampler = RssSampler(root_pid)
    t0 = time.perf_counter()
    sampler.sample(0.0)
    next_sample = [ns.sample_every]

    def on_tick(_):
        now = time.perf_counter() - t0
        if now >= next_sample[0]:
            sampler.sample(now)  # a few ms: the tick's request starts just after
            next_sample[0] += ns.sample_every
            top = max(sampler.procs.values(), key=lambda p: p.rss[-1][1] if p.rss else 0)
            print(f"  {now:6.0f} s: {top.role} {top.rss[-1][1] / MB:.0f} MB", flush=True)

    body = make_body(ns.seed, ns.input_len, ns.output_len)
    phases = {"all": None}
    if ns.hostile_fraction > 0:
        phases = {"clean": None, "hostile": max(1, round(1 / ns.hostile_fraction))}
    loads = {}
    for name, every in phases.items():
        rng = random.Random(ns.seed)
        loads[name] = asyncio.run(
            offer_load(
                base_url,
                ns.rate,
                ns.duration,
                ns.max_concurrency,
                body,
                ns.abort_every,
                on_tick,
                ns.request_timeout,
                hostile=None if every is None else (lambda k, rng=rng: hostile_request(rng)),
                hostile_every=every or 0,
                measure_ttft=ns.hostile_fraction > 0,
            )
        )
    load = LoadResult(
        sum(x.started for x in loads.values()),
        sum(x.skipped for x in loads.values()),
        sum((x.codes for x in loads.values()), Counter()),
        sum((x.hostile for x in loads.values()), Counter()),
    )
    kv = kv_blocks(status_base)
    sampler.sample(time.perf_counter() - t0)  # after the load: what is still held
    procs = list(sampler.procs.values())
    rows = growth_rows(procs, ns.baseline_s, ns.max_growth_mb)
    workload = {
        k: getattr(ns, k)
        for k in (
            "rate",
            "duration",
            "max_concurrency",
            "request_timeout",
            "input_len",
            "output_len",
            "abort_every",
            "hostile_fraction",
            "sample_every",
            "max_growth_mb",
            "num_workers",
            "serve_args",
            "seed",
        )
    }
    return {
        "workload": workload,
        "started": load.started,
        "skipped": load.skipped,
        "codes": dict(load.codes),
        "hostile_codes": dict(load.hostile),
        "ttft_ms": {name: ttft_stats(x.ttft_s) for name, x in loads.items() if x.ttft_s},
        "kv_blocks": kv,
        "baseline_s": ns.baseline_s,
        "processes": rows,
        "pass": all(r["ok"] for r in rows),
        "samples": [asdict(p) for p in procs],
    }


def run(ns) -> int:
    http, grpc = free_port(), free_port()
    cmd = serve_command(ns, http, grpc)
    print("starting: " + shlex.join(cmd[1:]), flush=True)
    server = ServeProcess(cmd)
    try:
        if server.proc.poll() is not None:
            raise RuntimeError("shoal serve exited:\n" + "".join(server.lines[-40:]))
        base = f"http://127.0.0.1:{http}"
        report = soak(ns, base + "/v1", base, server.proc.pid)
    finally:
        server.stop()
    report["command"] = shlex.join(cmd[1:])
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    svg = os.path.splitext(ns.output)[0] + ".svg"
    procs = [Proc(**s) for s in report["samples"]]
    with open(svg, "w") as f:
        f.write(rss_plot(procs, f"RSS under {ns.rate:g} req/s for {ns.duration:g} s"))
    print_report(report)
    print(f"wrote {ns.output} and {svg}")
    return 0 if report["pass"] else 1
