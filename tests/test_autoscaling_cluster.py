"""Slow tier: autoscaling on queue depth in a real local Ray cluster (room
for three workers on a tiny model). A burst that queues on the one worker
raises the workers to three, and the requests still waiting move to the
new ones; idleness brings them back to one within the downscale delay,
and a worker chosen to go drains first: its streams in flight finish, no
new request reaches it. Every request of the burst and every long stream
completes and equals its undisturbed run.

Nothing here assumes the machine's speed: two hold requests fill the one
worker's running slots until the burst has moved (the client then cancels
them), and the long streams are sized from the pace measured here."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from serving import local_cluster_app
from tiny_models import make_tiny_model

from shoal.proto.utils import cdiv
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc
from shoal.workers import LLM, SamplingParams

pytestmark = pytest.mark.slow
APP = "shoal-autoscaling"
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 1.0, 5.0
# The hold requests may grow to this context while the workers come: at the
# tiny model's pace here that is minutes, and they are cancelled in seconds.
HOLD_CONTEXT = 1 << 16
HOLD = ["Hold the first slot", "Hold the second slot"]
# One worker runs 2 sequences at once: with HOLD running, a burst of 48
# queues 48 deep, and the policy asks for ceil(48 / 2) workers, bounded to 3.
ENGINE = dict(max_num_seqs=2, num_kv_blocks=2 * HOLD_CONTEXT // 16 + 2048, num_threads=1)
BURST = [
    f"{p} {i}"
    for i, p in enumerate(
        [
            "The quick brown fox",
            "Paged attention keeps",
            "def add(a, b):",
            "Hello, world! How are",
            "Numbers: 0 1 2",
            "I am fine, thank",
        ]
        * 8
    )
]
BURST_TOKENS = 256
# In flight when their workers are told to go: each lasts LONG_S alone at the pace measured here,
# the time this test allows the scale-down (DOWNSCALE_DELAY_S + 15 s), plus 5 s for the probes after it.
LONG = ["Continuous batching rebuilds", "keys and values in"]
LONG_S = DOWNSCALE_DELAY_S + 20.0
EXACT_TOKENS = 2048  # of a long stream, checked token for token against its reference


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny model, with room for the hold requests and the long streams."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-long")), max_position_embeddings=HOLD_CONTEXT)


def _greedy(llm: LLM, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.token_ids, time.perf_counter() - t0


def long_reply_lasting(llm: LLM, prompt: str, seconds: float) -> list[int]:
    """The greedy reply to `prompt` that takes `seconds` or more alone here,
    and at most 1.8x that. Each try is timed and the next grows the length
    at most 1.5x: a step's cost grows with the context, so a length fitted
    from short runs can miss by far (it missed by 7x on a fast machine, and
    on a loaded one the fit itself was noise). A try that took r < 1 of
    `seconds` leads to one of at most max(1.5^2 r, (1.2 / r)^2 r) < 1.8."""
    cap = HOLD_CONTEXT - 64
    n = 2048
    while True:
        ids, took = _greedy(llm, prompt, n)
        print(f"\nlong stream: {n} tokens, {took:.1f} s alone here (sized for {seconds:g} s)")
        if took >= seconds or n == cap:
            return ids
        n = min(cap, max(n + 1, int(n * min(1.5, 1.2 * seconds / took))))


@pytest.fixture(scope="module")
def reference(model) -> dict[str, list[int]]:
    """Greedy replies of the burst, and of LONG, sized so that each lasts
    at least LONG_S alone (in the cluster each has a worker of one thread,
    as here, sharing the cores with the others)."""
    llm = LLM(model=model, num_kv_blocks=4096, num_threads=1, max_num_seqs=64)
    outs = llm.generate(BURST, SamplingParams(temperature=0, max_tokens=BURST_TOKENS, ignore_eos=True))
    ref = {p: o.token_ids for p, o in zip(BURST, outs)}
    llm = LLM(model=model, num_kv_blocks=HOLD_CONTEXT // 16, num_threads=1, max_num_seqs=1)
    ref[LONG[0]] = long_reply_lasting(llm, LONG[0], LONG_S)
    ref[LONG[1]], took = _greedy(llm, LONG[1], len(ref[LONG[0]]))
    print(f"long stream: {len(ref[LONG[1]])} tokens, {took:.1f} s alone here")
    return ref


async def generate(addr: str, prompt: str, max_tokens: int) -> dict:
    out = {"tokens": [], "worker": None, "reason": None}
    async with grpc.aio.insecure_channel(addr) as ch:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for m in pb_grpc.ShoalStub(ch).Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=600):
            out["tokens"] += m.token_ids
            if m.HasField("finished"):
                out["worker"], out["reason"] = m.finished.worker, m.finished.finish_reason
    out["end"] = time.monotonic()
    return out


async def hold(addr: str, prompt: str, started: asyncio.Event) -> None:
    """A stream that runs until cancelled (or its HOLD_CONTEXT ends): sets
    `started` at its first token, when it has one of the worker's slots."""
    async with grpc.aio.insecure_channel(addr) as ch:
        sampling = pb.SamplingParams(max_tokens=HOLD_CONTEXT - 64, temperature=0, ignore_eos=True)
        async for _ in pb_grpc.ShoalStub(ch).Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=600):
            started.set()


def load(addr: str) -> dict[str, pb.WorkerLoad]:
    with grpc.insecure_channel(addr) as ch:
        return {w.worker: w for w in pb_grpc.ShoalStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10).workers}


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
            states = {
                str(getattr(k, "value", k)): v
                for k, v in status.applications[APP].deployments["Worker"].replica_states.items()
            }
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
    with local_cluster_app(
        APP,
        model=model,
        num_workers=1,
        min_workers=1,
        max_workers=3,
        target_queue_depth=2.0,
        upscale_delay_s=UPSCALE_DELAY_S,
        downscale_delay_s=DOWNSCALE_DELAY_S,
        # Longer than a long stream can take here, however loaded the machine: a drain cut short
        # hands the stream to the survivor (it is never lost), and then no stream ran where a worker went.
        drain_timeout_s=600.0,
        **ENGINE,
    ) as (_, addr):
        timeline = asyncio.run(scenario(addr, reference))
    print("\nautoscaling timeline (s):", {k: round(v, 1) for k, v in timeline.items()})


async def scenario(addr: str, reference: dict[str, list[int]]) -> dict[str, float]:
    replicas = Replicas()
    poller = asyncio.ensure_future(replicas.poll())
    try:
        await replicas.until(lambda s: running(s) == 1, 60)
        first = await asyncio.to_thread(workers_reporting, addr)
        assert len(first) == 1

        # Two streams fill the one worker's slots, so a burst after them stays
        # queued there, however fast the machine, until the client lets go.
        started = [asyncio.Event() for _ in HOLD]
        holds = [asyncio.ensure_future(hold(addr, p, e)) for p, e in zip(HOLD, started)]
        deadline = time.monotonic() + 60
        while not all(e.is_set() for e in started):
            for t in holds:
                if t.done():
                    t.result()  # its error, if it failed
            assert time.monotonic() < deadline, f"the hold requests never streamed: {[e.is_set() for e in started]}"
            await asyncio.sleep(0.05)

        # A burst queues on the one worker: up to three, and its queue moves to the new ones.
        t0 = time.monotonic()
        burst = [asyncio.ensure_future(generate(addr, p, BURST_TOKENS)) for p in BURST]
        t_up = await replicas.until(lambda s: running(s) == 3, 90)
        # Moved: the first worker keeps its share of the queue, the mean over three.
        deadline = time.monotonic() + 30
        while len(now := await asyncio.to_thread(load, addr)) < 3 or now[first[0]].num_waiting > cdiv(len(BURST), 3):
            assert time.monotonic() < deadline, {w: (x.num_running, x.num_waiting) for w, x in now.items()}
            await asyncio.sleep(0.1)
        assert not any(t.done() for t in holds), "a hold request ended before the burst had moved"
        for t in holds:
            t.cancel()
        await asyncio.gather(*holds, return_exceptions=True)
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
        long = [asyncio.ensure_future(generate(addr, p, len(reference[p]))) for p in LONG]
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
            # Whole: every token, to the last. Equal to the reference made alone for the first
            # EXACT_TOKENS: tens of thousands of greedy tokens deep, a random tiny model meets
            # near-ties where a neighbour in the batch (a different summation order) may tip one.
            assert len(r["tokens"]) == len(reference[p]) and r["reason"] == "length", p
            assert r["tokens"][:EXACT_TOKENS] == reference[p][:EXACT_TOKENS], p
        drained = [r for r in longs if r["worker"] not in survivor]
        assert drained, "no long stream ran on a worker that went"
        t_gone = await replicas.until(lambda s: running(s) == 1 and sum(s.values()) == 1, 60)
        assert t_gone >= max(r["end"] for r in drained) - 0.5
        assert await asyncio.to_thread(workers_reporting, addr) == survivor
        return {
            "scale_up_1_to_3": t_up - t0,
            "burst": t_idle - t0,
            "scale_down_3_to_1_after_idle": t_down - t_idle,
            "drained_and_gone_after_idle": t_gone - t_idle,
        }
    finally:
        poller.cancel()
