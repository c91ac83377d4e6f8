"""Slow tier: failover in a real local Ray cluster (two workers on the tiny
model), through the real HTTP (openai client) and gRPC fronts. A worker's
process is killed, or its engine made to stall, under concurrent streams:
every stream completes and equals its undisturbed run."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import grpc
import pytest
from prompts import SHORT_PROMPTS
from serving import local_cluster_app

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
APP = "shoal-failover"
PROMPTS = SHORT_PROMPTS
GREEDY = dict(temperature=0.0, max_tokens=160, ignore_eos=True)
ACT_S = 5.0  # a disturbed run's streams last at least about this long after their 10th chunk
MAX_TOKENS = 480  # 16 streams of this many fit one worker's 512 blocks of 16 (after a failover)


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with local_cluster_app(
        APP, model=tiny_model, num_workers=2, num_threads=1, num_kv_blocks=512, stall_timeout_s=2.0, drain_timeout_s=5.0
    ) as (base, addr):
        wait_for_workers(addr, 2, 120)
        yield base, addr


# ---- clients -------------------------------------------------------------------


async def grpc_stream(addr: str, prompt: str, sampling: dict, out: dict) -> dict:
    out.update(tokens=[], text="", times=[], finished=None)
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pb_grpc.ShoalStub(ch).Generate(
            pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(**sampling)), timeout=180
        )
        async for m in call:
            out["tokens"] += m.token_ids
            out["text"] += m.text
            out["times"].append(time.monotonic())
            if m.HasField("finished"):
                out["finished"] = (
                    m.finished.finish_reason,
                    m.finished.usage.prompt_tokens,
                    m.finished.usage.completion_tokens,
                )
    return out


async def http_stream(base: str, prompt: str, sampling: dict, out: dict) -> dict:
    import openai

    out.update(tokens=None, text="", times=[], finished=None)
    s = dict(sampling)
    extra = {"ignore_eos": s.pop("ignore_eos")} if "ignore_eos" in s else {}
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=180) as client:
        model = (await client.models.list()).data[0].id
        stream = await client.completions.create(
            model=model, prompt=prompt, stream=True, extra_body=extra, stream_options={"include_usage": True}, **s
        )
        reason = None
        async for chunk in stream:
            if chunk.choices:
                out["text"] += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
                out["times"].append(time.monotonic())
            if chunk.usage:
                out["finished"] = (reason, chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return out


async def run_streams(base: str, addr: str, sampling: list[dict], act=None) -> tuple[list[dict], str | None, float]:
    """One stream per sampling dict, alternately gRPC and HTTP over the
    prompts, all at once. With `act`: once every stream has 10 chunks,
    act(victim) on the worker running the most of them. Returns the streams'
    results, the victim and when the act began."""
    outs = [{"times": []} for _ in sampling]
    tasks = [
        asyncio.ensure_future(
            grpc_stream(addr, PROMPTS[i % len(PROMPTS)], s, outs[i])
            if i % 2 == 0
            else http_stream(base, PROMPTS[i % len(PROMPTS)], s, outs[i])
        )
        for i, s in enumerate(sampling)
    ]
    victim, t_act = None, 0.0
    try:
        while act is not None:
            await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks), "a stream ended before the worker was disturbed"
            if min(len(o["times"]) for o in outs) >= 10:
                workers = await asyncio.to_thread(load, addr)
                victim = max(workers, key=lambda w: w.num_running).worker
                t_act = time.monotonic()
                await asyncio.to_thread(act, victim)
                acted = time.monotonic()
                break
        results = list(await asyncio.gather(*tasks))
        if act is not None:
            assert all(o["times"][-1] > acted for o in results), "a stream ended before the act was done"
        return results, victim, t_act
    finally:
        for t in tasks:
            t.cancel()


def paced(base: str, addr: str, sampling: list[dict]) -> tuple[list[dict], list[dict]]:
    """The undisturbed run of `sampling`, its streams made longer (from the
    pace this run measured) where they did not last ACT_S after their 10th
    chunk: then the act lands mid-stream on any machine. Returns the
    sampling used and its results."""
    ref, _, _ = asyncio.run(run_streams(base, addr, sampling))
    took = min(r["times"][-1] - r["times"][9] for r in ref)
    if took < ACT_S:
        scale = ACT_S / max(took, 1e-3)
        sampling = [dict(s, max_tokens=min(MAX_TOKENS, math.ceil(s["max_tokens"] * scale))) for s in sampling]
        ref, _, _ = asyncio.run(run_streams(base, addr, sampling))
    return sampling, ref


def load(addr: str) -> list:
    with grpc.insecure_channel(addr) as ch:
        return list(pb_grpc.ShoalStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10).workers)


def wait_for_workers(addr: str, n: int, timeout: float, gone: str | None = None) -> list:
    """Until n workers report (none of them `gone`), each idle with all its blocks free."""
    deadline = time.monotonic() + timeout
    workers = []
    while time.monotonic() < deadline:
        try:
            workers = load(addr)
        except grpc.RpcError:
            workers = []
        if (
            len(workers) == n
            and gone not in {w.worker for w in workers}
            and all(w.num_running == 0 and w.num_free_blocks == w.num_total_blocks for w in workers)
        ):
            return workers
        time.sleep(0.5)
    raise AssertionError(f"{n} idle workers never reported (without {gone}): {workers}")


def replica_actor(worker: str, app: str = APP):
    """The Serve replica actor of the worker named `worker` (its replica id) in `app`."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if (
            a["namespace"] == "serve"
            and a["name"].startswith(f"SERVE_REPLICA::{app}#Worker#")
            and a["name"].endswith("#" + worker)
        ):
            return ray.get_actor(a["name"], namespace="serve")
    raise AssertionError(f"no replica actor for worker {worker}")


def kill_process(worker: str, app: str = APP) -> None:
    import ray

    pid = ray.get(replica_actor(worker, app).__ray_call__.remote(lambda replica: os.getpid()), timeout=10)
    os.kill(pid, signal.SIGKILL)


def stall_engine(worker: str) -> None:
    """Block the worker's engine-core thread (AsyncEngine.stall), reached
    through Serve's replica actor: its health must notice on its own."""
    import ray

    def stall(replica):
        replica._replica_impl._user_callable_wrapper.user_callable.engine.stall(300.0)

    ray.get(replica_actor(worker).__ray_call__.remote(stall), timeout=10)


def same(got: list[dict], ref: list[dict]) -> None:
    for i, (g, r) in enumerate(zip(got, ref)):
        assert (g["tokens"], g["text"], g["finished"]) == (r["tokens"], r["text"], r["finished"]), i


def gaps_ms(results: list[dict], t_act: float | None = None) -> list[float]:
    """Each stream's longest wait between chunks: after the act, or (None)
    after its 10th chunk."""
    out = []
    for r in results:
        ts = r["times"][9:] if t_act is None else [t_act] + [t for t in r["times"] if t > t_act]
        out.append(1000 * max((b - a for a, b in zip(ts, ts[1:])), default=0.0))
    return out


# ---- tests ---------------------------------------------------------------------------


def test_killed_worker_process_16_greedy_streams_all_complete_as_undisturbed(cluster):
    base, addr = cluster
    sampling = [dict(GREEDY, max_tokens=GREEDY["max_tokens"] + i) for i in range(16)]
    sampling, ref = paced(base, addr, sampling)
    got, victim, t_kill = asyncio.run(run_streams(base, addr, sampling, kill_process))
    same(got, ref)
    gaps, calm = gaps_ms(got, t_kill), gaps_ms(ref)
    print(
        f"\nkilled {victim}: 16/16 complete; each stream's longest gap between chunks (ms): after the kill "
        f"max {max(gaps):.0f}, median {sorted(gaps)[8]:.0f}; undisturbed max {max(calm):.0f}, "
        f"median {sorted(calm)[8]:.0f}"
    )
    wait_for_workers(addr, 2, 90, gone=victim)  # replaced; nothing left running anywhere


def test_killed_worker_seeded_sampled_streams_go_on_with_the_same_draws(cluster):
    base, addr = cluster
    wait_for_workers(addr, 2, 90)
    sampling = [dict(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=160, ignore_eos=True) for i in range(4)]
    sampling, ref = paced(base, addr, sampling)
    got, victim, _ = asyncio.run(run_streams(base, addr, sampling, kill_process))
    same(got, ref)
    assert len({r["text"] for r in ref}) == 4
    wait_for_workers(addr, 2, 90, gone=victim)


def test_stalled_engine_is_replaced_and_its_requests_finish_elsewhere(cluster):
    base, addr = cluster
    wait_for_workers(addr, 2, 90)
    sampling = [dict(GREEDY) for _ in range(8)]
    sampling, ref = paced(base, addr, sampling)
    got, victim, t_stall = asyncio.run(run_streams(base, addr, sampling, stall_engine))
    same(got, ref)
    gaps = gaps_ms(got, t_stall)
    t0 = time.monotonic()
    wait_for_workers(addr, 2, 120, gone=victim)
    print(
        f"\nstalled {victim} (stall timeout 2 s): 8/8 complete, longest gap {max(gaps):.0f} ms; "
        f"replaced {time.monotonic() - t0:.0f} s after the streams ended"
    )
