"""`shoal serve` as users run it: a real local Ray cluster with two workers on
the default model, reached by the official openai client and by gRPC stubs."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving import free_port

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.workers import LLM, SamplingParams

pytestmark = pytest.mark.slow
KEY = "test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
# The drain test's stream lasts about STREAM_S at the pace measured in it; the drain waits up to DRAIN_S for it.
STREAM_S, DRAIN_S = 10.0, 60
PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):", "Once upon a time"]


class Server:
    def __init__(self):
        self.http, self.grpc = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "shoal.cluster.cli",
            "serve",
            "--num-workers",
            "2",
            "--api-key",
            KEY,
            "--max-waiting",
            "2",
            "--max-num-seqs",
            "2",
            "--num-kv-blocks",
            "512",
            "--num-threads",
            "1",
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--drain-timeout",
            str(DRAIN_S),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(300):
            self.stop()
            raise RuntimeError("shoal serve did not become ready:\n" + "".join(self.lines[-40:]))
        self.base = f"http://127.0.0.1:{self.http}/v1"

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "; Ctrl-C stops" in line:  # the banner, not a replica's "kernels ready in" log line
                self.ready.set()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"])
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of LLM.generate on the same model, one thread as each worker."""
    llm = LLM(num_kv_blocks=512, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=16)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    chat_ids = llm.tokenizer.encode(chat, add_special_tokens=False)
    outs = llm.generate(PROMPTS + [chat_ids], params)
    return {p: o for p, o in zip(PROMPTS + ["chat"], outs)}


def _client(server, **kw):
    import openai

    return openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, **kw)


def test_openai_client_completions_and_chat_equal_llm_generate(server, reference):
    client = _client(server)
    for p in PROMPTS:
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16, temperature=0)
        ref = reference[p]
        assert r.choices[0].text == ref.text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(ref.token_ids)
        chunks = list(
            client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=p,
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    ref = reference["chat"]
    msgs = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    # A stop string taken from inside the greedy reply ends it just before.
    stop = ref.text[4:9]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == ref.text[: ref.text.index(stop)] and r.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_n_choices_are_their_seeds_alone_and_share_one_worker(server):
    """n=2 with a seed: choice k is seed + k run alone, the prompt counts
    once, and both samples ran on one worker (its log lines say which)."""
    client = _client(server)
    args = dict(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=8, seed=11)
    both = client.completions.create(n=2, **args)
    alone = [client.completions.create(**dict(args, seed=11 + k)) for k in range(2)]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    wants = [f"request {both.id}-{k} finished: " for k in range(2)]
    deadline = time.monotonic() + 15  # Ray forwards a replica's stderr to the driver every few hundred ms
    while time.monotonic() < deadline and not all(any(w in ln for ln in server.lines) for w in wants):
        time.sleep(0.1)
    lines = [next(ln for ln in server.lines if w in ln) for w in wants]
    assert len({ln.split(")", 1)[0] for ln in lines}) == 1, lines  # "(ServeReplica:shoal:Worker pid=...)"


def test_each_request_is_logged_by_its_worker_under_both_ids(server):
    """The worker's line for a request (counts, never text) reaches the
    console that started the cluster, as Serve's own replica lines do."""
    r = httpx.post(
        server.base + "/completions",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "log-me-7"},
        json={"prompt": PROMPTS[3], "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    want = f"request {r.json()['id']} (client id 'log-me-7') finished: length, "
    deadline = time.monotonic() + 15  # Ray forwards a replica's stderr to the driver every few hundred ms
    while time.monotonic() < deadline and not any(want in ln for ln in server.lines):
        time.sleep(0.1)
    mine = [ln for ln in server.lines if want in ln]
    assert len(mine) == 1 and "ServeReplica:shoal:Worker" in mine[0], "".join(server.lines[-30:])
    assert "3 output tokens" in mine[0] and PROMPTS[3] not in mine[0]


def test_grpc_stream_info_health_reflection_and_both_workers_used(server, reference):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        stub = shoal_pb2_grpc.ShoalStub(ch)
        workers = set()
        for p in PROMPTS:
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(text=p, sampling=pb.SamplingParams(max_tokens=16, temperature=0)), metadata=AUTH
                )
            )
            assert [t for m in msgs for t in m.token_ids] == reference[p].token_ids
            assert "".join(m.text for m in msgs) == reference[p].text
            workers.add(msgs[-1].finished.worker)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
        assert (info.model, info.num_workers, info.vocab_size) == ("SmolLM2-135M-Instruct", 2, 49152)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="shoal.v1.Shoal"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        names = [
            s.name
            for r in refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=AUTH
            )
            for s in r.list_services_response.service
        ]
        assert "shoal.v1.Shoal" in names

        # Concurrent requests spread over both workers.
        async def spread():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc}") as ach:
                astub = shoal_pb2_grpc.ShoalStub(ach)
                calls = [
                    astub.Generate(pb.GenerateRequest(text=p, sampling=pb.SamplingParams(max_tokens=8)), metadata=AUTH)
                    for p in PROMPTS
                ]
                return [[m async for m in c][-1].finished.worker for c in calls]

        workers |= set(asyncio.run(spread()))
        assert len(workers) == 2, workers
    assert httpx.get(f"http://127.0.0.1:{server.http}/health").status_code == 200


def _all_free(stub) -> bool:
    load = stub.GetLoad(pb.GetLoadRequest(), metadata=AUTH).workers
    return len(load) == 2 and all(w.num_free_blocks == w.num_total_blocks and w.num_running == 0 for w in load)


def _seconds_until_free(stub, free: bool = True) -> float:
    """Seconds until every worker is idle with all blocks free (or, with
    free=False, until some worker is not); inf after 10 s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        if _all_free(stub) == free:
            return time.monotonic() - t0
        time.sleep(0.02)
    return float("inf")


def test_cancel_and_deadline_free_the_blocks_within_a_second(server):
    long = pb.SamplingParams(max_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        stub = shoal_pb2_grpc.ShoalStub(ch)
        call = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], sampling=long), metadata=AUTH)
        for i, _ in enumerate(call):
            if i == 5:
                break
        assert not _all_free(stub)
        call.cancel()
        assert _seconds_until_free(stub) < 1.0
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=long), metadata=AUTH, timeout=1.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _seconds_until_free(stub) < 1.0


def test_http_stream_closed_midway_frees_the_blocks(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        stub = shoal_pb2_grpc.ShoalStub(ch)
        with httpx.stream(
            "POST",
            server.base + "/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200, r.read()
            # Hold the line iterator: a `for ... break` over r.iter_lines()
            # drops it, and closing it hangs up the connection there and then.
            stream = r.iter_lines()
            lines = [next(stream) for _ in range(11)]
            assert "[DONE]" not in "".join(lines), lines
            # The request is 5 tokens into 400, ~20 s at a worker's one
            # thread: the workers' stats, read by a broadcast, show it running.
            assert _seconds_until_free(stub, free=False) < 1.0
        # Leaving the block closes the stream midway.
        assert _seconds_until_free(stub) < 1.0


def test_flood_past_max_waiting_gets_429_and_admitted_ones_are_right(server, reference):
    prompts = PROMPTS * 5

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(
                *(
                    c.post(
                        server.base + "/completions",
                        headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": p, "max_tokens": 16, "temperature": 0},
                    )
                    for p in prompts
                )
            )

    rs = asyncio.run(flood())
    codes = [r.status_code for r in rs]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    for p, r in zip(prompts, rs):
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == reference[p].text
        else:
            assert r.json()["error"]["type"] == "rate_limit_error"


def test_auth_and_bad_requests(server):
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="wrong", max_retries=0).completions.create(
            model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2
        )
    assert httpx.post(server.base + "/completions", json={"prompt": "hi"}).status_code == 401
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as ch:
        stub = shoal_pb2_grpc.ShoalStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(pb.GetModelInfoRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text=""), metadata=AUTH))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.value.details()
    client = _client(server)
    for kwargs, param in (
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "x " * 9000}, "prompt"),
        ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "hi", "top_p": 7}, "top_p"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="SmolLM2-135M-Instruct", **kwargs)
        assert err.value.body["param"] == param
    bad = httpx.post(
        server.base + "/completions",
        content=b"{oops",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    untyped = httpx.post(server.base + "/completions", content=b"{}", headers={"Authorization": f"Bearer {KEY}"})
    assert untyped.status_code == 415 and untyped.json()["error"]["code"] == "unsupported_media_type"
    wrong_type = httpx.post(
        server.base + "/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    )
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"
    ok = client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bench_serve_measures_an_openai_url(server, tmp_path):
    """`shoal bench serve --url` against the running server (no timing is asserted)."""
    import json

    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.cluster.cli",
            "bench",
            "serve",
            "--url",
            server.base,
            "--api-key",
            KEY,
            "--served-model",
            "SmolLM2-135M-Instruct",
            "--num-prompts",
            "3",
            "--request-rate",
            "1",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--output",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    row = json.loads(out.read_text())["results"][0]
    assert (row["completed"], row["failed"]) == (3, 0) and row["output_throughput"] > 0
    assert row["ttft_ms"]["p50"] > 0 and (tmp_path / "bench.svg").exists()


def _seconds_per_token(server) -> float:
    """A stream's decode pace on this server and machine, measured now: the
    time between its first and last of 32 tokens."""
    stamps = []
    with httpx.stream(
        "POST",
        server.base + "/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": PROMPTS[3], "max_tokens": 32, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                stamps.append(time.monotonic())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def test_ctrl_c_drains_streams_then_stops_the_cluster(server):
    """Last: stops the module's server. The stream in flight is sized from the
    pace measured here to last ~10 s, far longer than Ctrl-C takes to reach
    the router, and well inside the drain timeout; nothing waits on a sleep."""
    pace = _seconds_per_token(server)
    max_tokens = min(4000, math.ceil(STREAM_S / pace))
    print(f"\ndrained stream: {max_tokens} tokens at {pace * 1e3:.1f} ms/token")
    result, streaming = {}, threading.Event()

    def stream():
        with httpx.stream(
            "POST",
            server.base + "/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": PROMPTS[3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
            timeout=DRAIN_S,
        ) as r:
            lines = []
            for ln in r.iter_lines():
                if ln:
                    lines.append(ln)
                    streaming.set()
            result["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(60), "the stream never started"
    server.proc.send_signal(signal.SIGINT)
    # Admitted until the router hears of the drain, then refused; the stream goes on meanwhile.
    while (
        refused := httpx.post(
            server.base + "/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": "hi", "max_tokens": 2},
        )
    ).status_code == 200:
        assert t.is_alive(), f"the stream ({max_tokens} tokens) ended before the drain began"
    assert refused.status_code == 503, refused.text
    assert t.is_alive() and "lines" not in result, f"the stream ({max_tokens} tokens) ended before the refusal"
    t.join(DRAIN_S)
    assert result["lines"][-1] == "data: [DONE]" and '"finish_reason":"length"' in result["lines"][-2]
    assert server.proc.wait(90) == 0
    assert any("stopped" in ln for ln in server.lines)
