"""Failover in-process: real Workers on the tiny model behind FailoverPool,
with a pool double whose workers die like killed processes. A stream that
loses its worker goes on elsewhere and equals an undisturbed run, token for
token and character for character (the cluster's tests are the slow tier's)."""

from __future__ import annotations

import asyncio
import math
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import pytest
from engine_hold import EngineHold, until
from prompts import SHORT_PROMPTS
from step_gate import StepGate

from shoal.proto.errors import EngineDeadError
from shoal.proto.messages import GenerateRequest, RequestFinished
from shoal.router.fronts.frontend import Frontend, ModelInfo, ServingError
from shoal.router.routing.failover import FailoverPool, WorkerLost
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.model_executor.loader.detokenizer import IncrementalDetokenizer
from shoal.workers.worker import Worker

PROMPTS = SHORT_PROMPTS


class DyingWorkers:
    """In-process workers that die like killed processes: worker i dies
    once it has streamed die_after[i] tokens (to all its streams together).
    Every stream on a dead worker then raises WorkerLost at its next delta,
    its request aborted in that worker's engine (gone, as a dead process's
    are); the delta that would pass the mark is never delivered. New
    requests go to the live, healthy worker with the fewest in flight (Serve
    replaces a replica whose health check fails); every send is logged.
    gates (a StepGate per worker): each engine steps once per delta asked
    for, so every delta is one token, however fast the machine."""

    def __init__(
        self, workers: list[Worker], die_after: dict[int, int] | None = None, gates: list[StepGate] | None = None
    ):
        self.workers, self.die_after, self.gates = workers, dict(die_after or {}), gates
        self.dead: set[int] = set()
        self.tokens = [0] * len(workers)
        self.in_flight = [0] * len(workers)
        self.sent: list[tuple[int, GenerateRequest]] = []

    def _usable(self, i: int) -> bool:
        if i in self.dead:
            return False
        try:
            self.workers[i].check_health()
            return True
        except EngineDeadError:
            return False

    async def generate(self, request: GenerateRequest):
        live = [i for i in range(len(self.workers)) if self._usable(i)]
        if not live:
            raise WorkerLost("no worker is left", held=False)
        i = min(live, key=self.in_flight.__getitem__)
        self.sent.append((i, request))
        self.in_flight[i] += 1
        gate = self.gates[i] if self.gates else None
        try:
            if gate:
                gate.grant()  # the first token
            async with aclosing(self.workers[i].generate(request)) as stream:
                async for msg in stream:
                    n = len(getattr(msg, "token_ids", ()))  # a WorkerError has none
                    if i not in self.dead and self.tokens[i] + n > self.die_after.get(i, math.inf):
                        self.dead.add(i)
                    if i in self.dead:
                        raise WorkerLost(f"worker {i} died")
                    self.tokens[i] += n
                    yield msg
                    if gate:
                        gate.grant()  # the next token, now that the reader asks for it
        finally:
            self.in_flight[i] -= 1

    async def info(self):
        return self.workers[0].info()

    async def stats(self):
        return [w.stats() for w in self.workers]


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished: list[RequestFinished] = field(default_factory=list)


async def run(pool, request: GenerateRequest) -> Result:
    r = Result()
    async with aclosing(pool.generate(request)) as stream:
        async for msg in stream:
            r.tokens += msg.token_ids
            r.text += msg.text
            if msg.finished is not None:
                r.finished.append(msg.finished)
    return r


@asynccontextmanager
async def workers(model: str, n: int = 2, stall_timeout_s: float = 0.0):
    ws = [
        Worker(
            EngineArgs(model=model, num_kv_blocks=128, num_threads=1), max_waiting=64, stall_timeout_s=stall_timeout_s
        )
        for _ in range(n)
    ]
    try:
        yield ws
    finally:
        for w in ws:
            await w.engine.shutdown()


async def all_free(ws: list[Worker]) -> bool:
    """Every live engine ends with no request and every block free: nothing
    left behind by a lost stream, nothing run twice."""
    for _ in range(200):
        if all(
            not w.engine.engine.requests and w.stats().num_free_blocks == w.stats().num_total_blocks
            for w in ws
            if w.engine.failed is None
        ):
            return True
        await asyncio.sleep(0.01)
    return False


def request(ws: list[Worker], prompt: str, rid: str = "r", **params) -> GenerateRequest:
    return GenerateRequest(rid, ws[0].engine.engine.tokenize(prompt), SamplingParams(**params))


def same(got: Result, ref: Result) -> None:
    assert got.tokens == ref.tokens and got.text == ref.text
    assert len(got.finished) == len(ref.finished) == 1
    g, f = got.finished[0], ref.finished[0]
    assert (g.finish_reason, g.stop_reason, g.num_prompt_tokens, g.num_output_tokens) == (
        f.finish_reason,
        f.stop_reason,
        f.num_prompt_tokens,
        f.num_output_tokens,
    )


@pytest.mark.parametrize("k", [0, 7, 23], ids=["before-first-token", "mid-stream", "just-before-the-end"])
def test_greedy_stream_goes_on_elsewhere_without_gap_or_repeat(tiny_model, k):
    async def main():
        async with workers(tiny_model) as ws:
            req = request(ws, PROMPTS[0], temperature=0, max_tokens=24, ignore_eos=True)
            ref = await run(FailoverPool(DyingWorkers(ws)), req)
            # One token per delta (StepGate), so the death lands after exactly k tokens however fast the machine.
            pool = DyingWorkers(ws, die_after={0: k}, gates=[StepGate(w) for w in ws])
            got = await run(FailoverPool(pool), req)
            return ref, got, pool, ws[1].name, await all_free(ws)

    ref, got, pool, survivor, free = asyncio.run(main())
    same(got, ref)
    assert len(ref.tokens) == 24 and got.finished[0].worker == survivor and free
    (w0, first), (w1, second) = pool.sent
    n = second.num_resumed_tokens
    assert (w0, w1) == (0, 1) and (n == 0 if k == 0 else 0 < n <= k)
    assert second.prompt_token_ids == first.prompt_token_ids + ref.tokens[:n]
    assert second.request_id != first.request_id


def test_seeded_sampled_stream_goes_on_with_the_same_draws(tiny_model):
    sampled = dict(temperature=1.0, top_k=40, seed=1234, frequency_penalty=0.5, min_tokens=12, max_tokens=30)

    async def main():
        async with workers(tiny_model) as ws:
            req = request(ws, PROMPTS[1], **sampled)
            ref = await run(FailoverPool(DyingWorkers(ws)), req)
            got = await run(FailoverPool(DyingWorkers(ws, die_after={0: 6})), req)
            # No seed: the router draws one before the first send, and the re-send keeps it.
            unseeded = request(ws, PROMPTS[1], **dict(sampled, seed=None))
            pool = DyingWorkers(ws, die_after={0: 6})
            lost = await run(FailoverPool(pool), unseeded)
            seeds = {r.params.seed for _, r in pool.sent}
            again = await run(FailoverPool(DyingWorkers(ws)), request(ws, PROMPTS[1], **dict(sampled, seed=min(seeds))))
            return ref, got, lost, again, seeds, len(pool.sent), await all_free(ws)

    ref, got, lost, again, seeds, sends, free = asyncio.run(main())
    same(got, ref)
    assert len(seeds) == 1 and None not in seeds and sends == 2
    same(lost, again)
    assert free


def test_stop_string_spanning_the_seam_is_found_and_cut(tiny_model):
    async def main():
        async with workers(tiny_model) as ws:
            base = dict(temperature=0, max_tokens=24, ignore_eos=True)
            req = request(ws, PROMPTS[2], **base)
            reply = await run(FailoverPool(DyingWorkers(ws)), req)
            detok = IncrementalDetokenizer(ws[0].engine.engine.tokenizer, req.prompt_token_ids, [], True)
            ends = []  # the text's length after each token
            for t in reply.tokens:
                detok.add(t)
                ends.append(len(detok.text))
            text = detok.text
            assert text == reply.text
            # A stop string of 2 + 2 characters across the seam after token j.
            for j in range(4, 20):
                end = ends[j - 1]
                stop = text[end - 2 : end + 2]
                if end - ends[j - 2] >= 2 and ends[j] - end >= 2 and text.find(stop) == end - 2:
                    break
            else:
                pytest.skip("no token pair of 2+ characters each in this reply")
            stopped = request(ws, PROMPTS[2], stop=[stop], **base)
            ref = await run(FailoverPool(DyingWorkers(ws)), stopped)
            pool = DyingWorkers(ws, die_after={0: j}, gates=[StepGate(w) for w in ws])  # one token per delta
            got = await run(FailoverPool(pool), stopped)
            return text, end, stop, ref, got, pool, await all_free(ws)

    text, end, stop, ref, got, pool, free = asyncio.run(main())
    assert ref.text == text[: end - 2] and ref.finished[0].stop_reason == stop
    same(got, ref)
    resumed = pool.sent[1][1]
    # The client had only part of the text when the worker died: the rest was held back as a possible stop.
    assert resumed.num_resumed_tokens > 0 and resumed.num_resumed_chars < end
    assert free


def test_16_concurrent_streams_survive_a_worker_death(tiny_model):
    async def main():
        async with workers(tiny_model) as ws:
            reqs = [
                request(ws, PROMPTS[i % 8], f"r{i}", temperature=0, max_tokens=20 + i % 5, ignore_eos=True)
                for i in range(16)
            ]
            refs = await asyncio.gather(*(run(FailoverPool(DyingWorkers(ws)), r) for r in reqs))
            pool = DyingWorkers(ws, die_after={0: 60})
            failover = FailoverPool(pool)
            got = await asyncio.gather(*(run(failover, r) for r in reqs))
            return refs, got, pool, failover.num_failovers, await all_free(ws)

    refs, got, pool, failovers, free = asyncio.run(main())
    for g, r in zip(got, refs):
        same(g, r)
    assert 0 in pool.dead and failovers >= 4 and len(pool.sent) == 16 + failovers
    assert free


def test_spent_retry_budget_or_no_worker_left_gives_unavailable(tiny_model):
    # The engines step once per delta read (StepGate): every delta is one token, so each cut below
    # falls at the same token on any machine, and 20 tokens never fit in what the cuts allow.
    class EveryStreamDies(DyingWorkers):
        async def generate(self, request):
            n = 0
            async with aclosing(super().generate(request)) as stream:  # its request is aborted as it dies
                async for msg in stream:
                    if n == 2:
                        raise WorkerLost("killed again")
                    n += 1
                    yield msg

    async def consume(fe: Frontend, ids: list[int]) -> tuple[list[int], ServingError | None]:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        got = []  # tokens per delta
        try:
            async for out in fe.generate(ids, params, fe.new_request_id("cmpl")):
                got.append(len(out.token_ids))
        except ServingError as e:
            return got, e
        return got, None

    async def main():
        async with workers(tiny_model) as ws:
            gates = [StepGate(w) for w in ws]
            info = ModelInfo.from_worker_info(ws[0].info(), 2)
            ids = ws[0].engine.engine.tokenize(PROMPTS[3])
            tokenizer = ws[0].engine.engine.tokenizer
            dying = EveryStreamDies(ws, gates=gates)
            spent = await consume(Frontend(FailoverPool(dying, max_retries=2, backoff_s=0.01), tokenizer, info), ids)
            gone = DyingWorkers(ws, die_after={0: 3, 1: 3}, gates=gates)
            none_left = await consume(Frontend(FailoverPool(gone, backoff_s=0.01), tokenizer, info), ids)
            return spent, len(dying.sent), none_left, [i for i, _ in gone.sent], await all_free(ws)

    (got, err), sends, (got2, err2), where, free = asyncio.run(main())
    assert sends == 3 and got == [1] * 6  # the first send and two re-sends, each cut after two deltas
    assert err.kind == "unavailable" and err.code == "worker_failed"
    assert where == [0, 1] and got2 == [1] * 6  # three tokens from each worker before it died
    assert err2.kind == "unavailable" and err2.code == "worker_failed"
    assert free


def test_a_stalled_engine_fails_its_health_check_and_its_requests_finish_elsewhere(tiny_model):
    async def main():
        async with workers(tiny_model, stall_timeout_s=0.4) as ws:
            reqs = [request(ws, PROMPTS[i], f"s{i}", temperature=0, max_tokens=60, ignore_eos=True) for i in range(6)]
            refs = [await run(FailoverPool(DyingWorkers(ws)), r) for r in reqs]
            await asyncio.sleep(0.6)  # idle past the timeout is no stall
            for w in ws:
                w.check_health()
            pool = DyingWorkers(ws)
            steps = ws[0].engine.engine.num_steps
            hold = EngineHold(ws[0], steps=5)  # its requests are mid-stream when it hangs, on any machine
            tasks = [asyncio.ensure_future(run(FailoverPool(pool), r)) for r in reqs]
            assert await until(lambda: hold.held(steps + 5)) < 10
            ws[0].engine.stall(30.0)  # the engine-core thread blocks, as in a hung step
            got = await asyncio.gather(*tasks)
            with pytest.raises(EngineDeadError, match="no progress"):
                ws[0].check_health()
            return refs, got, pool, await all_free(ws)

    refs, got, pool, free = asyncio.run(main())
    for g, r in zip(got, refs):
        same(g, r)
    moved = [r for i, r in pool.sent if i == 1 and r.num_resumed_tokens > 0]
    assert moved and free
