"""The request travels whole: the router's GenerateRequest is the object a
worker hands its engine, the engine-core thread applies, and the sequence
keeps. A field added to the message reaches the scheduler with no edit in
between (docs/development.md: a new request field)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

from shoal.proto.messages import GenerateRequest
from shoal.workers import AsyncEngine, EngineArgs, LLMEngine, SamplingParams
from shoal.workers.engine_commands import AddRequest
from shoal.workers.worker import Worker


@dataclasses.dataclass(slots=True)
class TenantRequest(GenerateRequest):
    """A field a later issue adds (here in a subclass: the message's own file is the first of the two edits)."""

    tenant: str = ""


def test_each_hop_takes_the_request_itself():
    assert list(inspect.signature(Worker.generate).parameters) == ["self", "request"]
    assert list(inspect.signature(AsyncEngine.generate).parameters) == ["self", "request"]
    assert [f.name for f in dataclasses.fields(AddRequest)] == ["request", "grammar"]
    assert list(inspect.signature(LLMEngine.add_request).parameters) == ["self", "request", "grammar"]


def test_a_new_field_reaches_the_scheduler_through_the_worker(tiny_model, monkeypatch):
    seen = []

    async def main():
        worker = Worker(EngineArgs(model=tiny_model, num_kv_blocks=64, num_threads=1), max_waiting=8)
        scheduler = worker.engine.engine.scheduler
        real_add = scheduler.add
        monkeypatch.setattr(scheduler, "add", lambda seq: seen.append(seq) or real_add(seq))
        request = TenantRequest("t1", [10, 11, 12], SamplingParams(max_tokens=3, temperature=0), tenant="blue")
        try:
            return [d async for d in worker.generate(request)]
        finally:
            await worker.engine.shutdown()

    deltas = asyncio.run(main())
    assert deltas[-1].finished is not None and deltas[-1].finished.num_output_tokens == 3
    (seq,) = seen
    assert seq.request.tenant == "blue"  # the scheduler reads the field where the router set it
    assert (seq.request_id, seq.token_ids[:3], seq.params.max_tokens) == ("t1", [10, 11, 12], 3)


def test_request_ids_are_checked_in_one_place(tiny_model):
    """The engine and the async engine refuse a bad or taken id with the same words."""
    import pytest

    from shoal.proto.errors import InvalidRequestError

    engine = LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=16))
    engine.add_request(GenerateRequest("a", [5, 6], SamplingParams(max_tokens=2)))
    for rid, words in (("a", "already in use"), ("", "non-empty string"), (None, "non-empty string")):
        with pytest.raises(InvalidRequestError, match=words):
            engine.add_request(GenerateRequest(rid, [5, 6], SamplingParams(max_tokens=2)))
        with pytest.raises(InvalidRequestError, match=words):
            engine.check_request(GenerateRequest(rid, [5, 6], SamplingParams(max_tokens=2)), in_flight={"b"})
    with pytest.raises(InvalidRequestError, match="already in use"):  # one queued in the async engine, not yet added
        engine.check_request(GenerateRequest("b", [5, 6], SamplingParams(max_tokens=2)), in_flight={"b"})
    engine.shutdown()


def test_the_engine_refuses_bad_fields_of_the_whole_request(tiny_model):
    """The fields the engine reads off the request itself are checked there, naming each."""
    import pytest

    from shoal.proto.errors import InvalidRequestError

    engine = LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=16))
    sp = SamplingParams(max_tokens=2)
    bad = [
        (GenerateRequest("p", "not ids", sp), "prompt"),
        (GenerateRequest("q", [5, 6], sp, priority=2**40), "priority"),
        (GenerateRequest("l", [5, 6], sp, lora_name=5), "model"),
        (GenerateRequest("u", [5, 6], sp, lora_name="nobody"), "model"),
        (GenerateRequest("g", [5, 6], sp, parent_request_id=7), "parent_request_id"),
    ]
    for request, field in bad:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(request)
        assert e.value.field == field
    assert not engine.requests  # nothing queued
    engine.shutdown()
