"""Async scheduling (--async-scheduling): the output thread makes each step's
text while the core thread runs the next step; every request's tokens, text
and finish are the same as with it off."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from engine_hold import EngineHold, until
from step_gate import StepGate

from shoal.proto.messages import GenerateRequest
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.workers import AsyncEngine, SamplingParams
from shoal.workers.llm_engine import PendingOutput

PROMPT = "The quick brown fox jumps over the lazy dog"


def _engine(tiny_model: str, on: bool) -> AsyncEngine:
    return AsyncEngine.from_engine_args(model=tiny_model, num_kv_blocks=256, num_threads=1, async_scheduling=on)


def _count_pending(monkeypatch) -> list[int]:
    """Counts the deltas whose text the output thread made."""
    made = [0]
    real = PendingOutput.resolve

    def resolve(self):
        made[0] += 1
        return real(self)

    monkeypatch.setattr(PendingOutput, "resolve", resolve)
    return made


async def _collect(aeng: AsyncEngine, rid: str, prompt, params: SamplingParams, **kw) -> dict:
    tokens, text, last = [], "", None
    async for d in aeng.generate(GenerateRequest(rid, aeng.engine.tokenize(prompt), params, **kw)):
        tokens += d.new_token_ids
        text += d.new_text
        last = d
    return {"tokens": tokens, "text": text, "finish": (last.finish_reason, last.stop_reason)}


def _requests(stop: str | None) -> dict[str, tuple]:
    """(prompt, params, generate kwargs) by request id: greedy, seeded, stop
    strings, max_tokens, n > 1 (a parallel-sampling group) and structured output."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    reqs = {
        "greedy": (PROMPT, greedy, {}),
        "short": ("Once upon a time", dataclasses.replace(greedy, max_tokens=3), {}),
        "seeded": (PROMPT + " again", seeded, {}),
        "regex": ("Name:", SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(regex="[a-z]{6}")), {}),
    }
    for k in range(3):
        reqs[f"group-{k}"] = ("A parallel", dataclasses.replace(seeded, seed=100 + k), {"parent_request_id": "group"})
    if stop is not None:
        reqs["stop"] = (PROMPT, dataclasses.replace(greedy, stop=[stop]), {})
    return reqs


def _run(tiny_model: str, on: bool, stop: str | None, made: list[int]) -> tuple[dict, int]:
    """Every request added before the first step (a hold), then free-running:
    the batches depend on the engine alone, so both modes run the same ones."""

    async def main():
        aeng = _engine(tiny_model, on)
        made[0] = 0
        hold = EngineHold(SimpleNamespace(engine=aeng))
        reqs = _requests(stop)
        tasks = {rid: asyncio.create_task(_collect(aeng, rid, p, sp, **kw)) for rid, (p, sp, kw) in reqs.items()}
        assert await until(lambda: len(aeng.engine.requests) == len(reqs), 30) < float("inf")
        hold.release()
        got = {rid: await t for rid, t in tasks.items()}
        stats = aeng.stats()
        await aeng.shutdown()
        assert stats.num_free_blocks == stats.num_total_blocks
        return got, made[0]

    return asyncio.run(main())


def test_outputs_match_with_async_scheduling_on_and_off(tiny_model, monkeypatch):
    made = _count_pending(monkeypatch)
    off, made_off = _run(tiny_model, False, None, made)
    # A stop string the greedy reply really holds, from its middle: that request stops early.
    text = off["greedy"]["text"]
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip())
    off, made_off = _run(tiny_model, False, stop, made)
    on, made_on = _run(tiny_model, True, stop, made)
    assert made_off == 0 and made_on > 0  # the output thread made the text of the deferred requests
    assert on == off
    assert off["stop"]["finish"] == ("stop", stop) and len(off["stop"]["tokens"]) < len(off["greedy"]["tokens"])
    assert len(off["short"]["tokens"]) == 3 and off["short"]["finish"] == ("length", None)
    assert off["greedy"]["text"] and off["seeded"]["text"]
    assert len({tuple(off[f"group-{k}"]["tokens"]) for k in range(3)}) > 1  # the group's seeds differ


def test_aborts_mid_stream_match_with_async_scheduling_on_and_off(tiny_model):
    """A consumer that leaves after a few tokens: one step at a time (a gate),
    each step's deltas delivered before the next, so the abort lands between
    the same two steps in both modes and the survivors' batches match."""

    async def main(on: bool):
        aeng = _engine(tiny_model, on)
        gate = StepGate(SimpleNamespace(engine=aeng))
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        got: dict[str, list[int]] = {"keep": [], "cut": [], "cut-late": []}
        left_after = {"cut": 2, "cut-late": 7}

        async def consume(rid, prompt):
            async for d in aeng.generate(GenerateRequest(rid, aeng.engine.tokenize(prompt), params)):
                got[rid] += d.new_token_ids
                if rid in left_after and len(got[rid]) >= left_after[rid]:
                    aeng.abort(rid)
                    return

        tasks = [asyncio.create_task(consume(rid, f"{PROMPT} {rid}")) for rid in got]
        eng = aeng.engine
        assert await until(lambda: len(eng.requests) == 3, 30) < float("inf")
        while not all(t.done() for t in tasks):
            steps = eng.num_steps
            gate.grant()

            def settled():
                aborted_in = any(r in eng.requests for r, n in left_after.items() if len(got[r]) >= n)
                return (
                    eng.num_steps > steps
                    and sum(map(len, got.values())) == eng.num_generation_tokens
                    and not aeng._pending
                    and not aborted_in
                )

            assert await until(lambda: settled() or all(t.done() for t in tasks), 30) < float("inf")
        gate.remove()
        stats = aeng.stats()
        await aeng.shutdown()
        assert stats.num_free_blocks == stats.num_total_blocks
        return got

    off, on = asyncio.run(main(False)), asyncio.run(main(True))
    assert on == off
    assert len(off["keep"]) == 16 and len(off["cut"]) == 2 and len(off["cut-late"]) == 7


def test_a_detokenizer_that_fails_ends_its_request_alone(tiny_model):
    """Under async scheduling the text is made on the output thread: a
    request whose detokenizer raises there ends with an error, and its blocks
    are freed; the others go on."""
    from shoal.proto.errors import RequestFailedError

    async def main():
        aeng = _engine(tiny_model, True)
        hold = EngineHold(SimpleNamespace(engine=aeng))
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        bad = asyncio.create_task(_collect(aeng, "bad", PROMPT, params))
        good = asyncio.create_task(_collect(aeng, "good", PROMPT + " too", params))
        assert await until(lambda: len(aeng.engine.requests) == 2, 30) < float("inf")

        def boom(token_id, check_stop=True):
            raise RuntimeError("detokenizer broke")

        aeng.engine.requests["bad"].detok.add = boom
        hold.release()
        try:
            await bad
            failed = None
        except RequestFailedError as e:
            failed = str(e)
        kept = await good
        assert await until(lambda: "bad" not in aeng.engine.requests, 30) < float("inf")
        stats = aeng.stats()
        await aeng.shutdown()
        return failed, kept, stats

    failed, kept, stats = asyncio.run(main())
    assert failed is not None and "detokenizer broke" in failed
    assert len(kept["tokens"]) == 8
    assert stats.num_free_blocks == stats.num_total_blocks
