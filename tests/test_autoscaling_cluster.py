"""Slow tier: autoscaling on queue depth in a real local Ray cluster (room
for three workers on a tiny model). A burst that queues on the one worker
raises the workers to three, and the requests still waiting move to the
new ones; idleness brings them back to one within the downscale delay,
and a worker chosen to go drains first: its streams in flight finish, no
new request reaches it. Every request completes and equals its
undisturbed run."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from serving import local_cluster_app
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc
from shoal.workers import LLM, SamplingParams
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
APP = "shoal-autoscaling"
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 1.0, 5.0
# One worker runs 2 sequences at once: a burst of 48 queues 46 deep, and
# the policy asks for ceil(46 / 2) workers, bounded to 3.
ENGINE = dict(max_num_seqs=2, num_kv_blocks=4096, num_threads=1)
BURST = [f"{p} {i}" for i, p in enumerate(["The quick brown fox", "Paged attention keeps", "def add(a, b):",
                                           "Hello, world! How are", "Numbers: 0 1 2", "I am fine, thank"] * 8)]  # fmt: skip
BURST_TOKENS = 256
# Long enough to outlast the downscale delay: in flight when their workers are told to go.
LONG = ["Continuous batching rebuilds", "keys and values in"]
LONG_TOKENS = 4000


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny model, with room for LONG_TOKENS."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-long")), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def reference(model) -> dict[str, list[int]]:
    llm = LLM(model=model, num_kv_blocks=4096, num_threads=1, max_num_seqs=64)
    outs = llm.generate(BURST, SamplingParams(temperature=0, max_tokens=BURST_TOKENS, ignore_eos=True))
    outs += llm.generate(LONG, SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True))
    return {p: o.token_ids for p, o in zip(BURST + LONG, outs)}


async def generate(addr: str, prompt: str, max_tokens: int) -> dict:
    out = {"tokens": [], "worker": None, "reason": None}
    async with grpc.aio.insecure_channel(addr) as ch:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for m in pb_grpc.ShoalStub(ch).Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=240):
            out["tokens"] += m.token_ids
            if m.HasField("finished"):
                out["worker"], out["reason"] = m.finished.worker, m.finished.finish_reason
    out["end"] = time.monotonic()
    return out


def workers_reporting(addr: str) -> list[str]:
    """The workers the router reaches now (GetLoad: a broadcast to the running ones)."""
    with grpc.insecure_channel(addr) as ch:
        return sorted(w.worker for w in pb_grpc.ShoalStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10).workers)


class Replicas:
    """Serve's replica states of the Worker deployment, polled in the
    background: the moments the counts first meet a condition."""

    def __init__(self):
        self.states: dict[str, int] = {}
        self.history: list[tuple[float, dict]] = []

    async def poll(self) -> None:
        from ray import serve

        while True:
            status = await asyncio.to_thread(serve.status)
            states = {str(getattr(k, "value", k)): v
                      for k, v in status.applications[APP].deployments["Worker"].replica_states.items()}  # fmt: skip
            if states != self.states:
                self.history.append((time.monotonic(), states))
            self.states = states
            await asyncio.sleep(0.2)

    async def until(self, cond, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while not cond(self.states):
            assert time.monotonic() < deadline, f"replica states never met the condition: {self.history}"
            await asyncio.sleep(0.05)
        return time.monotonic()


def running(states: dict) -> int:
    return states.get("RUNNING", 0)


def test_queue_depth_scales_workers_up_and_idleness_drains_them_back(model, reference):
    with local_cluster_app(APP, model=model, num_workers=1, min_workers=1, max_workers=3, target_queue_depth=2.0,
                           upscale_delay_s=UPSCALE_DELAY_S, downscale_delay_s=DOWNSCALE_DELAY_S,
                           drain_timeout_s=60.0, **ENGINE) as (_, addr):  # fmt: skip
        timeline = asyncio.run(scenario(addr, reference))
    print("\nautoscaling timeline (s):", {k: round(v, 1) for k, v in timeline.items()})


async def scenario(addr: str, reference: dict[str, list[int]]) -> dict[str, float]:
    replicas = Replicas()
    poller = asyncio.ensure_future(replicas.poll())
    try:
        await replicas.until(lambda s: running(s) == 1, 60)
        first = await asyncio.to_thread(workers_reporting, addr)
        assert len(first) == 1

        # A burst queues on the one worker: up to three, and its queue moves to the new ones.
        t0 = time.monotonic()
        burst = [asyncio.ensure_future(generate(addr, p, BURST_TOKENS)) for p in BURST]
        t_up = await replicas.until(lambda s: running(s) == 3, 90)
        assert not all(t.done() for t in burst), "the burst ended before the new workers came"
        results = await asyncio.gather(*burst)
        t_idle = time.monotonic()
        for p, r in zip(BURST, results):
            assert r["tokens"] == reference[p] and r["reason"] == "length", p
        served_by = {r["worker"] for r in results}
        # Every request went to the first worker (the only one when they came):
        # those the new workers served were handed back while still waiting.
        assert len(served_by) == 3 and first[0] in served_by, served_by
        three = await asyncio.to_thread(workers_reporting, addr)
        assert len(three) == 3

        # Two long streams start as the burst ends; with nothing waiting and 1
        # of 2 sequences running per worker, one worker is enough: two drain.
        long = [asyncio.ensure_future(generate(addr, p, LONG_TOKENS)) for p in LONG]
        t_down = await replicas.until(lambda s: running(s) == 1, DOWNSCALE_DELAY_S + 30)
        assert not any(t.done() for t in long), "the long streams ended before the scale-down"
        assert t_down - t_idle <= DOWNSCALE_DELAY_S + 15.0  # the delay, the metrics' push and the control loop
        deadline = time.monotonic() + 10
        while len(survivor := await asyncio.to_thread(workers_reporting, addr)) != 1:
            assert time.monotonic() < deadline, survivor
            await asyncio.sleep(0.1)
        # Draining workers take nothing new: requests now all go to the survivor.
        probes = await asyncio.gather(*(generate(addr, p, 16) for p in BURST[:4]))
        assert {r["worker"] for r in probes} == set(survivor)
        for p, r in zip(BURST, probes):
            assert r["tokens"] == reference[p][:16]
        assert not any(t.done() for t in long), "the long streams ended before the probes"

        # The streams on the draining workers finish, whole, and only then do their workers go.
        longs = await asyncio.gather(*long)
        for p, r in zip(LONG, longs):
            assert r["tokens"] == reference[p] and r["reason"] == "length", p
        drained = [r for r in longs if r["worker"] not in survivor]
        assert drained, "no long stream ran on a worker that went"
        t_gone = await replicas.until(lambda s: running(s) == 1 and sum(s.values()) == 1, 60)
        assert t_gone >= max(r["end"] for r in drained) - 0.5
        assert await asyncio.to_thread(workers_reporting, addr) == survivor
        return {"scale_up_1_to_3": t_up - t0, "burst": t_idle - t0, "scale_down_3_to_1_after_idle": t_down - t_idle,
                "drained_and_gone_after_idle": t_gone - t_idle}  # fmt: skip
    finally:
        poller.cancel()
