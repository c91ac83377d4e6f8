"""Constrained decoding in the engine, on the tiny random model: whatever a
random model samples, the mask keeps it inside the grammar; a constrained
row never disturbs the others; preemption and failover resume a guided
reply exactly where it stood."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
from prompts import SHORT_PROMPTS
from test_failover import DyingWorkers, all_free, run, same, workers

from shoal.proto.errors import InvalidRequestError
from shoal.proto.messages import GenerateRequest
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.router.routing.failover import FailoverPool
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.async_engine import AsyncEngine
from shoal.workers.llm import LLM
from shoal.workers.llm_engine import LLMEngine

# Every string bounded: a random model would never close an open one.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"]}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_threads=1, num_kv_blocks=256) as llm:
        yield llm


def guided(so: SO, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(structured_outputs=so, **kw)


def test_json_schema_replies_validate_for_every_seed(llm):
    outs = llm.generate(
        [SHORT_PROMPTS[i % len(SHORT_PROMPTS)] for i in range(12)],
        [guided(SO(json=PERSON), temperature=1.0, seed=s) for s in range(12)],
    )
    texts = set()
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
        texts.add(o.text)
    assert len(texts) > 6  # sampled, not one forced string
    # Unconstrained, the same seeds give no JSON at all: the mask did the work.
    free = llm.generate(SHORT_PROMPTS[:3], [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(3)])
    assert not any(o.text.startswith("{") for o in free)


def test_regex_choice_and_grammar_replies_match(llm):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    grammar = 'start: "ab" rest\nrest: "c" | "d" rest'  # Lark: "ab" then d* then c
    kinds = [SO(regex=pattern), SO(choice=("yes", "no", "maybe")), SO(grammar=grammar), SO(json_object=True)]
    params = [guided(k, temperature=1.0, seed=s, max_tokens=24) for s in range(4) for k in kinds[:3]]
    outs = llm.generate([SHORT_PROMPTS[0]] * len(params), params)
    for o, p in zip(outs, params):
        so = p.structured_outputs
        if so.regex:
            assert re.fullmatch(pattern, o.text) and o.finish_reason == "stop", o.text
        elif so.choice:
            assert o.text in so.choice and o.finish_reason == "stop"
        elif o.finish_reason == "stop":  # the grammar's d* may run past max_tokens
            assert re.fullmatch("abd*c", o.text), o.text
        else:
            assert re.fullmatch("abd*", o.text) and o.finish_reason == "length", o.text


def test_masked_batch_equals_each_row_alone(llm):
    """Grammar rows and free rows in one sampled batch: each equals its own run alone, same seed."""
    params = [
        guided(SO(json=PERSON), temperature=1.0, seed=7),
        SamplingParams(max_tokens=30, temperature=1.0, seed=8, ignore_eos=True),
        guided(SO(regex=r"[a-f]{5,40}"), temperature=0.8, top_p=0.9, seed=9),
        SamplingParams(max_tokens=30, temperature=0),
    ]
    prompts = SHORT_PROMPTS[:4]
    together = llm.generate(prompts, params)
    for prompt, p, t in zip(prompts, params, together):
        alone = llm.generate([prompt], [p])[0]
        assert (alone.token_ids, alone.text, alone.finish_reason) == (t.token_ids, t.text, t.finish_reason)


def test_eos_only_once_the_grammar_accepts_and_min_tokens_holds(llm):
    # "a" then as many more as it likes: EOS (or the end) is allowed after each a.
    outs = llm.generate(
        [SHORT_PROMPTS[0]] * 6,
        [guided(SO(regex="a+"), temperature=1.0, seed=s, max_tokens=12, min_tokens=5) for s in range(6)],
    )
    for o in outs:
        assert re.fullmatch("a+", o.text) and len(o.token_ids) >= 5, o.text
    # A grammar not complete at max_tokens ends with "length", as vLLM's does.
    o = llm.generate([SHORT_PROMPTS[0]], [guided(SO(regex="[a-z]{50}"), temperature=1.0, seed=1, max_tokens=4)])[0]
    assert o.finish_reason == "length" and re.fullmatch("[a-z]+", o.text)


def test_preempted_guided_sequences_equal_undisturbed_ones(tiny_model, llm):
    prompts = SHORT_PROMPTS[:6]
    params = [guided(SO(json=PERSON), temperature=1.0, seed=20 + i, max_tokens=64) for i in range(6)]
    ref = llm.generate(prompts, params)
    # A cache that holds about two of them at once: the rest wait, and running ones get preempted.
    with LLM(tiny_model, num_threads=1, num_kv_blocks=12, block_size=16) as small:
        got = small.generate(prompts, params)
        assert small.engine.scheduler.num_preemptions > 0
    for r, g in zip(ref, got):
        assert (g.token_ids, g.text, g.finish_reason) == (r.token_ids, r.text, r.finish_reason)


def test_failover_mid_json_replays_into_a_new_matcher(tiny_model):
    """The worker dies after 10 tokens of a guided reply; the next one replays them
    into a fresh matcher and the reply equals the undisturbed run."""
    sampled = dict(temperature=1.0, seed=4321, max_tokens=80, structured_outputs=SO(json=PERSON))

    async def main():
        async with workers(tiny_model) as ws:
            req = GenerateRequest("g", ws[0].engine.engine.tokenize(SHORT_PROMPTS[2]), SamplingParams(**sampled))
            ref = await run(FailoverPool(DyingWorkers(ws)), req)
            pool = DyingWorkers(ws, die_after={0: 10})
            got = await run(FailoverPool(pool), req)
            return ref, got, pool, await all_free(ws)

    ref, got, pool, free = asyncio.run(main())
    same(got, ref)
    jsonschema.validate(json.loads(got.text), PERSON)
    assert len(pool.sent) == 2 and pool.sent[1][1].num_resumed_tokens > 0 and free


def test_resumed_tokens_the_grammar_refuses_are_a_clear_error(tiny_model, llm):
    eng = llm.engine
    ids = eng.tokenize(SHORT_PROMPTS[0]) + eng.tokenize("hello")  # "hello" is no start of a JSON object
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(
            GenerateRequest("bad-resume", ids, guided(SO(json=PERSON)), num_resumed_tokens=len(eng.tokenize("hello")))
        )
    assert e.value.field == "structured_outputs" and "bad-resume" not in eng.requests


def test_prefix_cache_keys_ignore_the_grammar(llm):
    """Only sampled tokens are constrained: the same prompt hits the cache with or without one."""
    prompt = SHORT_PROMPTS[3] * 4
    llm.generate([prompt], [SamplingParams(max_tokens=2, temperature=0)])
    bm = llm.engine.block_manager
    before = bm.pool.num_hit_tokens
    llm.generate([prompt], [guided(SO(regex="[0-9]+"), temperature=0, max_tokens=2)])
    assert bm.pool.num_hit_tokens - before >= 16


def test_each_spec_compiles_once_and_the_cache_is_bounded(tiny_model):
    with LLM(tiny_model, num_threads=1, num_kv_blocks=64) as llm:
        so = llm.engine.structured_output
        so.cache_size = 3
        for _ in range(2):
            llm.generate([SHORT_PROMPTS[0]] * 3, [guided(SO(regex=f"x{i}"), temperature=0) for i in range(3)])
        assert so.num_compiled == 3 and so.num_cache_hits >= 3
        llm.generate([SHORT_PROMPTS[0]], [guided(SO(regex="y+"), temperature=0, max_tokens=3)])
        assert len(so._cache) == 3 and SO(regex="x0").digest not in so._cache  # the least recently used went


@pytest.mark.parametrize(
    "so, words",
    [
        (
            dict(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
            "$ref cycle",
        ),
        (dict(json={"type": "string", "if": {"type": "string"}}), "if"),
        (dict(regex="a(b"), "regex"),
        (dict(grammar="start: (foo"), "grammar"),
        (dict(json={"$ref": "#/$defs/missing"}), "missing"),
    ],
    ids=["ref-cycle", "unsupported-keyword", "bad-regex", "bad-grammar", "missing-ref"],
)
def test_specs_the_library_refuses_name_the_field(llm, so, words):
    with pytest.raises(InvalidRequestError) as e:  # the shape check, or the library's at compile
        llm.generate([SHORT_PROMPTS[0]], [guided(SO(**so))])
    assert e.value.field == "structured_outputs" and words in str(e.value)
    assert llm.generate([SHORT_PROMPTS[0]], [SamplingParams(max_tokens=3)])[0].finish_reason  # still serving


def test_a_slow_compile_is_refused_and_holds_no_one_else(tiny_model):
    """The compile is held by a hook past the timeout: that request is refused; one
    without a grammar, sent meanwhile, is served."""

    async def main():
        aeng = AsyncEngine(
            LLMEngine(EngineArgs(model=tiny_model, num_threads=1, num_kv_blocks=64, grammar_compile_timeout_s=0.3))
        )
        so = aeng.engine.structured_output
        release = threading.Event()
        real = so.backend.compile

        def held(params):
            release.wait(30)
            return real(params)

        so.backend.compile = held
        try:

            async def slow():
                async for _ in aeng.generate(
                    GenerateRequest("slow", aeng.engine.tokenize(SHORT_PROMPTS[0]), guided(SO(regex="z+")))
                ):
                    pass

            async def other():
                return [
                    d
                    async for d in aeng.generate(
                        GenerateRequest("free", aeng.engine.tokenize(SHORT_PROMPTS[1]), SamplingParams(max_tokens=4))
                    )
                ]

            slow_result, free = await asyncio.gather(slow(), other(), return_exceptions=True)
            release.set()
            return slow_result, free
        finally:
            release.set()
            await aeng.shutdown()

    slow_result, free = asyncio.run(main())
    assert isinstance(slow_result, InvalidRequestError) and "--grammar-compile-timeout-s" in str(slow_result)
    assert slow_result.field == "structured_outputs"
    assert free[-1].finish_reason == "length"


def test_stop_strings_and_seeds_work_on_guided_replies(llm):
    """A stop string ends a guided reply as any other (the text cut before it); the same
    seed gives the same guided reply."""
    so = SO(regex="[a-e]{8,40}")
    params = [guided(so, temperature=1.0, seed=s, max_tokens=40, stop=["e"]) for s in range(6)]
    outs = llm.generate([SHORT_PROMPTS[1]] * 6, params)
    assert all(o.finish_reason == "stop" and re.fullmatch("[a-d]*", o.text) for o in outs)
    assert any(len(o.text) < 8 for o in outs)  # cut by the stop string: the grammar alone needs 8
    again = llm.generate([SHORT_PROMPTS[1]] * 6, params)
    assert [o.text for o in again] == [o.text for o in outs]


def test_the_engine_bounds_and_checks_a_spec_however_it_was_built(llm):
    """Size, count and shape are checked in the engine too: a spec built past
    its constructor (a pickle, a front with a bug) is refused, the field named."""
    from shoal.proto.structured_params import MAX_CHOICES, MAX_SPEC_CHARS

    with pytest.raises(InvalidRequestError, match="at most"):
        SO(regex="a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(InvalidRequestError, match="at most"):
        SO(choice=tuple(f"c{i}" for i in range(MAX_CHOICES + 1)))
    eng = llm.engine
    for bad in (("choice", (1, 2)), ("regex", "a" * (MAX_SPEC_CHARS + 1)), ("json", "{not json")):
        so = SO(regex="ok", field="response_format")
        object.__setattr__(so, "regex", None)
        object.__setattr__(so, bad[0], bad[1])
        params = SamplingParams(max_tokens=4)
        params.structured_outputs = so  # past SamplingParams' own check, as an unpickled one would be
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request(GenerateRequest(f"tampered-{bad[0]}", eng.tokenize(eng.tokenize(SHORT_PROMPTS[0])), params))
        assert e.value.field == "response_format" and f"tampered-{bad[0]}" not in eng.requests
