"""Property test: any JSON value in any sampling field, any prompt shape.
Sent to an engine and to the OpenAI app, every request ends in a clear
refusal (InvalidRequestError / a 4xx) or a completed reply; the engine
never dies and no KV block stays held."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import http_client, make_frontend

from shoal.proto.messages import GenerateRequest
from shoal.workers import InvalidRequestError, LLMEngine, SamplingParams

MAX_MODEL_LEN = 32  # every request, however wild its max_tokens, stays short
FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
    "logit_bias",
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
# Values near the edges of each field's range, so that many requests are valid and run.
plausible = (
    st.integers(-3, 70)
    | st.floats(-1.5, 3.0)
    | st.sampled_from([0, 1, 2**31, 2**63, -(2**63), 2**64, 1e-300])
    | st.lists(st.integers(-2, 600), max_size=4)
    | st.lists(st.text(min_size=0, max_size=3), max_size=3)
    | st.dictionaries(st.integers(-1, 600), st.floats(-200, 200), max_size=3)
)
field_values = st.dictionaries(st.sampled_from(FIELDS), plausible | json_values, max_size=6)
prompts = (
    st.text(max_size=30)
    | st.lists(st.integers(-5, 600), max_size=20)
    | st.lists(st.integers(0, 511), min_size=1, max_size=20)
    | json_values
)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(model=tiny_model, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, num_threads=1)


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(st.tuples(prompts, field_values), min_size=1, max_size=12))  # ~2,600 requests in all
def test_any_request_to_the_engine_is_refused_clearly_or_completes(engine, batch):
    admitted = []
    for i, (prompt, fields) in enumerate(batch):
        rid = f"p{i}"
        try:
            params = SamplingParams(**fields)
            engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params))
        except InvalidRequestError:
            continue  # refused at once, with the field named
        admitted.append(rid)
    finished: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # an engine fault raises here and fails the test
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert set(finished) == set(admitted)
    assert all(reason in ("stop", "length") for reason in finished.values()), finished
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not engine.requests


body_values = st.dictionaries(
    st.sampled_from(FIELDS + ("n", "stream", "echo", "model", "stream_options")), plausible | json_values, max_size=6
)


def test_any_body_to_the_openai_app_gets_a_4xx_or_a_reply(tiny_model):
    """One app and two workers for all the examples: hypothesis drives them
    inside one event loop."""
    fe = make_frontend(tiny_model, num_workers=2, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, num_threads=1)
    loop = asyncio.new_event_loop()
    answers: dict[int, int] = {}

    @settings(
        max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(prompt=prompts, fields=body_values, chat=st.booleans())
    def one(prompt, fields, chat):
        if chat:
            body = {"messages": [{"role": "user", "content": prompt}], **fields}
        else:
            body = {"prompt": prompt, **fields}
        body.pop("stream", None)  # streams are the stream tests'; here one JSON answer each

        # NaN and Infinity go out as JSON's non-standard literals, as a hostile client would send them.
        content = json.dumps(body).encode()

        async def send():
            async with http_client(fe) as client:
                return await client.post(
                    "/v1/chat/completions" if chat else "/v1/completions",
                    content=content,
                    headers={"Content-Type": "application/json"},
                )

        r = loop.run_until_complete(send())
        answers[r.status_code] = answers.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
        payload = r.json()
        if r.status_code == 200:
            assert payload["choices"] and payload["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert payload["error"]["message"]

    try:
        one()
        for w in fe.pool.workers:
            assert w.engine.failed is None
            s = w.stats()
            assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0
    finally:
        for w in fe.pool.workers:
            loop.run_until_complete(w.engine.shutdown())
        loop.close()
    assert answers.get(200, 0) > 20 and sum(v for k, v in answers.items() if k >= 400) > 20, answers
