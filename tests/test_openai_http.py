"""The OpenAI HTTP front in-process over real Workers: shapes, errors,
back-pressure, auth and draining (the served cluster is the slow tier's)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest
from serving import http_client, make_frontend

from shoal.proto.messages import GenerateDelta
from shoal.workers import LLM, SamplingParams
from shoal.workers.worker import logger as worker_logger

PROMPT = "The quick brown fox"


def _events(body: str) -> list:
    lines = [ln[len("data: ") :] for ln in body.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completion_streamed_and_whole_both_equal_offline_with_usage(tiny_model):
    ref = LLM(tiny_model, num_kv_blocks=256).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]

    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            whole = (await c.post("/v1/completions", json=body)).json()
            streamed = await c.post(
                "/v1/completions", json=dict(body, stream=True, stream_options={"include_usage": True})
            )
        return whole, streamed

    whole, streamed = asyncio.run(main())
    assert whole["choices"][0]["text"] == ref.text
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {
        "prompt_tokens": len(ref.prompt_token_ids),
        "completion_tokens": 10,
        "total_tokens": len(ref.prompt_token_ids) + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = _events(streamed.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref.text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_chat_stop_string_logprobs_and_several_prompts(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            free = (
                await c.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
            ).json()
            text = free["choices"][0]["message"]["content"]
            stop = text[3:5]
            stopped = (
                await c.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 12,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stop": stop,
                        "logprobs": True,
                        "top_logprobs": 2,
                    },
                )
            ).json()
            multi = (
                await c.post(
                    "/v1/completions",
                    json={
                        "prompt": [PROMPT, [5, 6, 7]],
                        "max_tokens": 4,
                        "temperature": 0,
                        "ignore_eos": True,
                        "logprobs": 1,
                    },
                )
            ).json()
        return text, stop, stopped, multi

    text, stop, stopped, multi = asyncio.run(main())
    choice = stopped["choices"][0]
    assert choice["message"]["content"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in choice["logprobs"]["content"])
    assert [c["index"] for c in multi["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["token_logprobs"]) == 4 for c in multi["choices"])
    assert multi["usage"]["completion_tokens"] == 8


def test_the_response_id_is_the_engine_id_and_a_client_id_is_echoed_never_shared(tiny_model, caplog):
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    mine = {"X-Request-Id": "my-id"}

    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            same = await asyncio.gather(
                c.post("/v1/completions", json=body, headers=mine),
                c.post("/v1/completions", json=dict(body, stream=True), headers=mine),
                c.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                    headers=mine,
                ),
            )
            multi = await c.post("/v1/completions", json=dict(body, prompt=[PROMPT, PROMPT]))
        return same, multi

    with caplog.at_level(logging.INFO, logger=worker_logger.name):
        same, multi = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == worker_logger.name]
    whole, streamed, chat = same
    assert all(r.status_code == 200 and r.headers["x-request-id"] == "my-id" for r in same)
    chunk_ids = {c["id"] for c in _events(streamed.text)}
    assert len(chunk_ids) == 1
    ids = [whole.json()["id"], *chunk_ids, chat.json()["id"]]
    assert ids[0].startswith("cmpl-") and ids[1].startswith("cmpl-") and ids[2].startswith("chatcmpl-")
    assert len(set(ids)) == 3
    for rid in ids:
        assert sum(ln.startswith(f"request {rid} (client id 'my-id') finished: ") for ln in lines) == 1, lines
    multi_id = multi.json()["id"]
    assert "x-request-id" not in multi.headers
    assert sorted(ln.split()[1] for ln in lines if multi_id in ln) == [f"{multi_id}-0", f"{multi_id}-1"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stop": 3}, "stop"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(tiny_model, body, param):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            bad = await c.post("/v1/completions", json=body)
            good = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        return bad, good, fe

    bad, good, fe = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert good.status_code == 200 and fe.num_in_flight == 0


def test_malformed_json_oversize_unknown_model_and_chat_errors(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe, max_request_bytes=1000) as c:
            return [
                await c.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
                await c.post("/v1/completions", json={"prompt": "x" * 2000}),
                await c.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"}),
                await c.post("/v1/chat/completions", json={"messages": []}),
                await c.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
                ),
                await c.post("/v1/completions", json=[1, 2]),
                await c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "x" * 300}),
            ]

    r = asyncio.run(main())
    assert [x.status_code for x in r] == [400, 413, 404, 400, 400, 400, 400]
    assert "malformed JSON" in r[0].json()["error"]["message"]
    assert r[2].json()["error"]["code"] == "model_not_found"
    assert r[6].json()["error"]["param"] == "X-Request-Id"


def test_api_key_models_and_health(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, api_key="sekret")
        async with http_client(fe) as c:
            out = [
                await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                await c.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer wrong"}
                ),
                await c.post(
                    "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": "Bearer sekret"},
                ),
                await c.get("/v1/models", headers={"Authorization": "Bearer sekret"}),
                await c.get("/health"),
            ]
            await fe.drain(1.0)
            out += [
                await c.get("/health"),
                await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekret"}),
            ]
        return out, fe

    r, fe = asyncio.run(main())
    assert [x.status_code for x in r] == [401, 401, 200, 200, 200, 503, 503]
    assert r[0].json()["error"]["code"] == "invalid_api_key"
    assert r[3].json()["data"][0]["id"] == fe.info.model
    assert r[6].json()["error"]["type"] == "service_unavailable_error"


def test_flood_past_max_waiting_gets_429_and_admitted_requests_finish_right(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(12)]
    ref = {p: o.text for p, o in zip(prompts, LLM(tiny_model, num_kv_blocks=256).generate(prompts, params))}

    async def main():
        fe = make_frontend(tiny_model, max_waiting=2, max_num_seqs=2)
        async with http_client(fe) as c:
            rs = await asyncio.gather(
                *(
                    c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    for p in prompts
                )
            )
        return rs, await fe.load()

    rs, load = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    for p, r in zip(prompts, rs):
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == ref[p]
        else:
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert load[0].num_free_blocks == load[0].num_total_blocks


def test_a_worker_failing_midstream_ends_the_request_with_503_not_a_hang(tiny_model):
    class Broken:
        """A worker whose stream breaks after one delta, as a dead replica's does. The
        delta goes out without its finish: a slow reader can get all 8 tokens merged
        into the first delta, and the break must still come before the end."""

        def __init__(self, inner):
            self.inner = inner

        async def generate(self, request):
            async for msg in self.inner.generate(request):
                yield dataclasses.replace(msg, finished=None) if isinstance(msg, GenerateDelta) else msg
                raise ConnectionError("replica died")

    async def main():
        fe = make_frontend(tiny_model)
        fe.pool.workers[0] = Broken(fe.pool.workers[0])
        async with http_client(fe) as c:
            whole = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True})
            streamed = await c.post(
                "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True}
            )
        return whole, streamed, fe

    whole, streamed, fe = asyncio.run(main())
    assert whole.status_code == 503 and "worker" in whole.json()["error"]["message"]
    assert whole.json()["error"]["code"] == "worker_failed"
    events = streamed.text.split("\n\n")
    assert any('"code":"worker_failed"' in e for e in events) and events[-2] == "data: [DONE]"
    assert fe.num_in_flight == 0
