"""`shoal bench soak`'s counting and report, against a stand-in server: a
small script that prints `shoal serve`'s banner, answers completions by a
rule known here, starts a child process, and grows by 80 MB when the final
KV-block reading comes (after the load), so the growth check must fail."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter

import psutil
from aiohttp import web

from shoal.benchmarks import soak
from shoal.cluster.cli import main

STAND_IN = textwrap.dedent("""
    import json, subprocess, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    held = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for _ in range(1000):
                        self.wfile.write(b'data: {"choices": [{"text": "x"}]}\\n\\n')
                        self.wfile.flush()
                except OSError:
                    pass  # the client hung up, as asked
            elif req["seed"] % 3 == 0:
                self.answer(429, {"error": {"message": "busy"}})
            else:
                self.answer(200, {"choices": [{"text": "ok"}]})

        def do_GET(self):
            held.append(b"\\x01" * (80 << 20))  # touched: resident
            self.answer(200, {"workers": [{"worker": "w0", "num_running": 0, "num_waiting": 0,
                                           "num_free_blocks": 7, "num_total_blocks": 9}]})

    srv = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    print(f"child {child.pid}", flush=True)
    print("shoal: serving stand-in\\n  ready in 0.0 s; Ctrl-C stops", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass  # the child is left behind: the bench must end it
""")


def test_soak_counts_every_answer_samples_the_tree_and_fails_on_growth(tmp_path, monkeypatch, capsys):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(soak, "serve_command", lambda ns, http, grpc: [sys.executable, str(script), str(http)])
    out = tmp_path / "soak.json"
    rc = main(
        [
            "bench",
            "soak",
            "--rate",
            "40",
            "--duration",
            "1",
            "--abort-every",
            "4",
            "--sample-every",
            "0.25",
            "--baseline-s",
            "0",
            "--max-growth-mb",
            "50",
            "--output",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    # Every one of the 40 ticks started a request, and each is counted by its answer.
    expect = Counter("aborted" if k % 4 == 3 else "429" if k % 3 == 0 else "200" for k in range(40))
    assert r["started"] == 40 and r["skipped"] == 0 and r["codes"] == dict(expect)
    assert r["kv_blocks"] == [{"worker": "w0", "num_free_blocks": 7, "num_total_blocks": 9, "num_running": 0}]
    # The stand-in and its child were both sampled; only the stand-in grew (by its 80 MB; the child by no more
    # than the end of its own start-up) and so it fails.
    rows = {row["role"]: row for row in r["processes"]}
    server, child = rows["stand_in.py"], next(v for k, v in rows.items() if k != "stand_in.py")
    assert server["growth_mb"] > 75 and not server["ok"] and child["ok"] and abs(child["growth_mb"]) < 25
    assert r["pass"] is False and rc == 1
    assert all(len(s["rss"]) >= 3 for s in r["samples"])
    # The plot has one line per process; the table names the verdict.
    svg = ET.parse(out.with_suffix(".svg")).getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 1 + len(r["samples"])  # + the axes
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "stand_in.py" in printed and "429: 10" in printed
    # Nothing it started is left: the child the stand-in left behind was ended too.
    assert not psutil.pid_exists(child["pid"]) or psutil.Process(child["pid"]).status() == psutil.STATUS_ZOMBIE


def test_a_tick_that_finds_the_concurrency_cap_full_is_skipped_not_queued():
    async def go():
        release = asyncio.Event()
        ticks = []

        async def held(request):
            await release.wait()  # every request holds its slot until the last tick
            return web.json_response({}, status=200)

        app = web.Application()
        app.router.add_post("/v1/completions", held)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]

        def on_tick(t):
            ticks.append(t)
            if len(ticks) == 20:
                release.set()

        try:
            return await soak.offer_load(
                f"http://127.0.0.1:{port}/v1", 40, 0.5, 2, lambda k: {"seed": k}, on_tick=on_tick
            ), ticks
        finally:
            await runner.cleanup()

    res, ticks = asyncio.run(go())
    assert len(ticks) == 20 and res.started == 2 and res.skipped == 18 and res.codes == {"200": 2}


def test_processes_are_named_by_ray_title_script_or_program():
    assert soak.role(["ray::ServeReplica:shoal:Worker.generate"]) == "ServeReplica:shoal:Worker"
    assert soak.role(["ray::ServeController"]) == "ServeController"
    assert soak.role(["/venv/bin/python", "-m", "shoal.cluster.cli", "serve", "--num-workers", "1"]) == "shoal serve"
    assert soak.role(["/usr/bin/python3", "/x/ray/_private/log_monitor.py", "--a"]) == "log_monitor.py"
    assert soak.role(["/x/ray/core/src/ray/raylet/raylet", "--x"]) == "raylet"


def test_growth_is_measured_from_the_baseline_sample_to_the_last():
    procs = [
        soak.Proc(1, "a", [(0, 100 << 20), (10, 300 << 20), (20, 320 << 20), (30, 340 << 20)]),
        soak.Proc(2, "late", [(25, 10 << 20), (30, 90 << 20)]),
    ]
    rows = {r["role"]: r for r in soak.growth_rows(procs, baseline_s=10, limit_mb=50)}
    assert rows["a"]["baseline_mb"] == 300 and rows["a"]["growth_mb"] == 40 and rows["a"]["ok"]
    assert rows["a"]["peak_mb"] == 340 and rows["a"]["peak_growth_mb"] == 0  # one window: the same peak
    # A peak that keeps rising fails even when the last sample fell back (a step's buffers just freed).
    saw = [(t, (100 + t) << 20) for t in range(0, 600, 10)] + [(600, 300 << 20)]
    (row,) = soak.growth_rows([soak.Proc(3, "b", saw)], baseline_s=120, limit_mb=50)
    assert row["growth_mb"] == 300 - 220 and row["peak_growth_mb"] == 690 - 340 and not row["ok"]
    (row,) = soak.growth_rows([soak.Proc(3, "b", saw[:-1] + [(600, 100 << 20)])], baseline_s=120, limit_mb=50)
    assert row["growth_mb"] < 0 and not row["ok"]
    # One that started after the baseline is measured from its first sample.
    assert rows["late"]["baseline_t_s"] == 25 and rows["late"]["growth_mb"] == 80 and not rows["late"]["ok"]


def test_a_steps_vocabulary_wide_buffers_go_back_to_the_kernel_when_freed():
    """What held a served worker's memory: freed sampler-sized buffers of a
    non-main thread (the engine core's) kept by its malloc arena. Under the
    CPU malloc settings they are unmapped on free, so RSS falls back."""
    import threading

    import torch

    from shoal.workers.model_executor.memory.cpu_memory import keep_freed_memory_mapped, release_free_heap

    assert keep_freed_memory_mapped()
    proc, got = psutil.Process(), {}

    def step():
        bufs = [torch.ones(256, 49152) for _ in range(4)]  # 4 x 50 MB, touched: the default model's 256 rows
        got["held"] = proc.memory_info().rss
        del bufs
        got["freed"] = proc.memory_info().rss

    t = threading.Thread(target=step)
    t.start()
    t.join()
    assert got["held"] - got["freed"] > 180 * (1 << 20)
    release_free_heap()  # and trimming what is left free does not fail


def test_the_hostile_mix_is_counted_apart_and_the_honest_ttft_is_kept():
    from shoal.benchmarks.hostile import Hostile, hostile_request

    async def go():
        async def completions(request):
            req = await request.json()
            if "structured_outputs" in req:
                return web.json_response({"error": {"message": "bad"}}, status=400)
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(3):
                await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]

        def hostile(k):
            if k % 20 == 4:
                return Hostile("reader", "slow_reader", body={"prompt": "p", "stream": True})
            return Hostile("ref", "post", body={"prompt": "p", "structured_outputs": {"json": "["}})

        try:
            return await soak.offer_load(
                f"http://127.0.0.1:{port}/v1",
                200,
                0.2,
                100,
                lambda k: {"seed": k},
                hostile=hostile,
                hostile_every=5,
                measure_ttft=True,
            )
        finally:
            await runner.cleanup()

    res = asyncio.run(go())
    # 40 ticks: every 5th hostile (8), of which k % 20 == 4 read slowly (2); the 32 honest ones stream.
    assert res.started == 40 and res.hostile == {"ref: 400": 6, "reader: held": 2}
    assert res.codes == {"200": 32} and len(res.ttft_s) == 32 and all(t > 0 for t in res.ttft_s)
    # Every kind of the mix is a well-formed request the server can be sent.
    import random

    rng = random.Random(0)
    kinds = {hostile_request(rng).kind for _ in range(200)}
    assert kinds == {
        "ref_unicode",
        "deep_json",
        "ref_superscript",
        "logit_bias",
        "fanout",
        "tools",
        "slow_reader",
        "half_open",
    }
