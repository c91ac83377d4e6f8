"""Each bad input is refused at submission with a ValueError naming the
field; requests already running go on untouched."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from engine_hold import EngineHold, until

from shoal.proto.messages import GenerateRequest
from shoal.workers import AsyncEngine, InvalidRequestError, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(model=tiny_model, num_kv_blocks=64, max_model_len=512)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("temperature", dict(temperature=-0.1)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-2)),
        ("max_tokens", dict(max_tokens=0)),
        ("min_p", dict(min_p=2.0)),
    ],
)
def test_bad_sampling_values(field, kwargs):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_params_mutated_after_creation_are_checked_again(engine):
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request(GenerateRequest("mutated", [5, 6], p))


def test_empty_prompt(engine):
    for prompt in ([], ""):
        with pytest.raises(InvalidRequestError, match="prompt is empty") as e:
            engine.add_request(GenerateRequest("empty", engine.tokenize(prompt), SamplingParams()))
        assert e.value.field == "prompt"


def test_too_long_for_max_model_len(engine):
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        engine.add_request(GenerateRequest("long", [5] * 500, SamplingParams(max_tokens=20)))
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        engine.add_request(GenerateRequest("long2", [5] * 600, SamplingParams(max_tokens=1)))
    assert e.value.field == "prompt"


def test_token_ids_outside_vocabulary(engine):
    for bad in ([5, 512], [-1, 3]):
        with pytest.raises(InvalidRequestError, match="vocabulary") as e:
            engine.add_request(GenerateRequest("oov", engine.tokenize(bad), SamplingParams()))
        assert e.value.field == "prompt"


def test_prompt_that_never_fits_the_cache(tiny_model):
    small = LLMEngine(model=tiny_model, num_kv_blocks=4, block_size=16)  # 64 tokens in all
    with pytest.raises(InvalidRequestError, match="KV blocks") as e:
        small.add_request(GenerateRequest("huge", [5] * 60, SamplingParams(max_tokens=10)))
    assert e.value.field == "prompt"
    small.add_request(GenerateRequest("fits", [5] * 50, SamplingParams(max_tokens=10)))  # 60 tokens: fits


def test_duplicate_request_id(engine):
    engine.add_request(GenerateRequest("dup", [5, 6, 7], SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request(GenerateRequest("dup", [5, 6, 7], SamplingParams(max_tokens=2)))
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_requests_do_not_disturb_running_ones(tiny_model):
    async def main():
        engine = AsyncEngine.from_engine_args(model=tiny_model, num_kv_blocks=64)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        alone = [
            t async for d in engine.generate(GenerateRequest("a", [10, 11, 12, 13], params)) for t in d.new_token_ids
        ]

        async def good():
            return [
                t
                async for d in engine.generate(GenerateRequest("b", [10, 11, 12, 13], params))
                for t in d.new_token_ids
            ]

        # "b" runs a few steps, then the engine holds it: it is running while the bad ones come, on any machine.
        hold = EngineHold(SimpleNamespace(engine=engine), steps=3)
        steps = engine.engine.num_steps
        task = asyncio.create_task(good())
        assert await until(lambda: hold.held(steps + 3)) < 10
        errors = 0
        for bad in ([], [999999], [5] * 5000):
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate(GenerateRequest("bad", bad, params)):
                    pass
            errors += 1
        bad_params = SamplingParams()
        bad_params.top_k = -5
        with pytest.raises(InvalidRequestError, match="top_k"):
            async for _ in engine.generate(GenerateRequest("bad", [5], bad_params)):
                pass
        hold.release()
        got = await asyncio.wait_for(task, 30)
        await engine.shutdown()
        return alone, got, errors

    alone, got, errors = asyncio.run(main())
    assert got == alone and errors == 3
