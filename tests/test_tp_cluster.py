"""Slow tier: tensor-parallel workers in a served cluster on logical GPUs
(ray.init(num_gpus=4)): two replicas of two ranks each behind the router,
and a rank killed under load (its replica's streams fail over)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc
import httpx
import pytest
from serving import local_cluster_app

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

KILL_RUN_S = 10.0  # the killed run's streams last at least about this long undisturbed
MAX_TOKENS = 480  # 4 streams of this many fill a replica's 128 blocks of 16 without preemption


@pytest.fixture(scope="module")
def cluster(tiny_model):
    # Workers ask for logical GPUs and, finding no CUDA, run on the CPU.
    with local_cluster_app(
        "shoal-tp",
        num_gpus=4,
        model=tiny_model,
        num_workers=2,
        tensor_parallel_size=2,
        num_threads=1,
        num_kv_blocks=128,
        max_num_seqs=8,
    ) as (base, grpc_addr):
        wait_healthy(base, 120)
        yield base, grpc_addr


def wait_healthy(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{base} never became healthy")


def load(grpc_addr: str) -> list:
    with grpc.insecure_channel(grpc_addr) as ch:
        return list(pb_grpc.ShoalStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10).workers)


def rank_actors() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("shoal-tp-")]


async def stream_completions(
    base: str, n: int, max_tokens: int, ends: list[float] | None = None, **sampling
) -> list[tuple[int, str]]:
    """n concurrent streamed completions; each gives (status, text or error).
    ends: each stream's end (time.monotonic()) is appended to it."""
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]

    async def one(c: httpx.AsyncClient, i: int):
        body = {
            "model": model,
            "prompt": f"The quick brown fox {i}",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            **sampling,
        }
        try:
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                text = "".join([line async for line in r.aiter_lines()])
                return r.status_code, text
        except httpx.HTTPError as e:  # the stream cut mid-way
            return -1, repr(e)
        finally:
            if ends is not None:
                ends.append(time.monotonic())

    async with httpx.AsyncClient(timeout=httpx.Timeout(90.0)) as c:
        return await asyncio.gather(*(one(c, i) for i in range(n)))


def test_two_tp_replicas_both_take_http_requests_and_report_blocks(cluster):
    base, grpc_addr = cluster
    info = httpx.get(base + "/v1/models", timeout=10).json()
    assert info["data"], info
    with grpc.insecure_channel(grpc_addr) as ch:
        assert pb_grpc.ShoalStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).tensor_parallel_size == 2
    assert len(rank_actors()) == 2  # one other rank per replica

    # Long streams in flight: both replicas run some of them, and report blocks in use.
    seen_running: dict[str, int] = {}

    async def watch():
        task = asyncio.ensure_future(stream_completions(base, 8, 200))
        while not task.done():
            for w in await asyncio.to_thread(load, grpc_addr):
                assert w.num_total_blocks == 128
                if w.num_running:
                    assert w.num_free_blocks < w.num_total_blocks
                    seen_running[w.worker] = max(seen_running.get(w.worker, 0), w.num_running)
            await asyncio.sleep(0.2)
        return task.result()

    results = asyncio.run(watch())
    assert all(status == 200 and "[DONE]" in text for status, text in results), results
    assert len(seen_running) == 2, seen_running
    assert all(w.num_free_blocks == w.num_total_blocks for w in load(grpc_addr))


def completion_text(sse: str) -> tuple[str, str | None]:
    """A streamed completion's text and finish reason, from its SSE lines."""
    events = [json.loads(e) for e in sse.split("data: ")[1:] if e.strip() != "[DONE]"]
    assert all("error" not in e for e in events), sse[-300:]
    return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]


def test_a_killed_rank_gets_its_replica_replaced_and_its_streams_go_on(cluster):
    import ray

    base, grpc_addr = cluster
    before = {w.worker for w in load(grpc_addr)}
    victim = rank_actors()[0]
    # Streams long enough to outlast the kill on any machine: sized from the pace of a measured run.
    max_tokens, t0 = 300, time.monotonic()
    undisturbed = asyncio.run(stream_completions(base, 8, max_tokens, temperature=0))
    per_token = (time.monotonic() - t0) / max_tokens
    if per_token * max_tokens < KILL_RUN_S:
        max_tokens = min(MAX_TOKENS, math.ceil(KILL_RUN_S / per_token))
        undisturbed = asyncio.run(stream_completions(base, 8, max_tokens, temperature=0))

    async def kill_under_load():
        ends: list[float] = []
        task = asyncio.ensure_future(stream_completions(base, 8, max_tokens, ends, temperature=0))
        # Both replicas run streams (each in its first tokens): the kill lands under load.
        while not (len(w := await asyncio.to_thread(load, grpc_addr)) == 2 and all(x.num_running for x in w)):
            assert not task.done(), "the streams ended before both replicas ran some"
            await asyncio.sleep(0.05)
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
        t0 = time.monotonic()
        results = await task
        return results, time.monotonic() - t0, min(ends) - t0

    results, took, first_end = asyncio.run(kill_under_load())
    assert first_end > 0, "a stream ended before the kill: it tested no failover"
    # Every stream went on (those of the dead rank's replica on the other
    # replica) and equals its undisturbed run; none hung.
    assert took < 90
    assert all(status == 200 for status, _ in results), results
    assert [completion_text(r[1]) for r in results] == [completion_text(r[1]) for r in undisturbed]
    print(f"\n8/8 served after the rank was killed, in {took:.1f} s")

    # Serve's health check fails the replica; a new one (new ranks) takes its place.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            workers = {w.worker for w in load(grpc_addr)}
        except grpc.RpcError:
            workers = set()
        names = {a["name"] for a in rank_actors()}
        if len(workers) == 2 and workers != before and victim["name"] not in names and len(names) == 2:
            break
        time.sleep(1.0)
    else:
        raise AssertionError(f"the replica was not replaced: workers {workers}, ranks {names}")
    wait_healthy(base, 60)
    results = asyncio.run(stream_completions(base, 4, 20))
    assert all(status == 200 and "[DONE]" in text for status, text in results), results
