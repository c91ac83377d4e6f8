"""The request fields clients send beside the sampling ones: `echo`, `user`,
`stream_options.continuous_usage_stats`, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import pytest
from serving import http_client, make_frontend

from shoal.cluster.options import ServeOptions
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.workers import LLM, SamplingParams

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hi"}]


def _client(fe, **kw) -> openai.AsyncOpenAI:
    """The official client over the app in-process."""
    app = OpenAIApp(fe, ServeOptions().max_request_bytes).app
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shoal")
    return openai.AsyncOpenAI(base_url="http://shoal/v1", api_key="none", http_client=transport, max_retries=0, **kw)


def test_echo_prepends_the_prompt_whole_and_streamed(tiny_model):
    ref = LLM(tiny_model, num_kv_blocks=256).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    ids = ref.prompt_token_ids

    async def main():
        fe = make_frontend(tiny_model)
        args = dict(model=fe.info.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, echo=True)
        async with _client(fe) as c:
            whole = await c.completions.create(prompt=PROMPT, **args)
            by_ids = await c.completions.create(prompt=ids, **args)
            two = await c.completions.create(prompt=[PROMPT, ids], **args)
            chunks = [ch async for ch in await c.completions.create(prompt=PROMPT, stream=True, **args)]
        return whole, by_ids, two, chunks, fe.tokenizer.decode(ids, skip_special_tokens=False)

    whole, by_ids, two, chunks, ids_text = asyncio.run(main())
    assert whole.choices[0].text == PROMPT + ref.text
    assert by_ids.choices[0].text == ids_text + ref.text
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [PROMPT + ref.text, ids_text + ref.text]
    assert whole.usage.prompt_tokens == len(ids)  # the echo is text, never counted again
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(ch.choices[0].text for ch in chunks) == PROMPT + ref.text
    assert not any(ch.choices[0].text.startswith(PROMPT) for ch in chunks[1:])


def test_continuous_usage_is_on_every_chunk_growing_to_the_final_usage(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        opts = {"include_usage": True, "continuous_usage_stats": True}
        args = dict(model=fe.info.model, max_tokens=8, extra_body={"ignore_eos": True}, stream=True)
        async with _client(fe) as c:
            text = [ch async for ch in await c.completions.create(prompt=PROMPT, stream_options=opts, **args)]
            chat = [ch async for ch in await c.chat.completions.create(messages=MESSAGES, stream_options=opts, **args)]
            plain = [ch async for ch in await c.completions.create(prompt=PROMPT, **args)]
            # As in vLLM, continuous usage needs include_usage too.
            alone = {"continuous_usage_stats": True}
            plain += [ch async for ch in await c.completions.create(prompt=PROMPT, stream_options=alone, **args)]
        return text, chat, plain

    text, chat, plain = asyncio.run(main())
    for chunks in (text, chat):
        *deltas, final = chunks
        assert final.choices == [] and final.usage.completion_tokens == 8
        made = [ch.usage.completion_tokens for ch in deltas]
        assert made == sorted(made) and made[-1] == 8
        for ch in deltas:
            u = ch.usage
            assert (
                u.prompt_tokens == final.usage.prompt_tokens and u.total_tokens == u.prompt_tokens + u.completion_tokens
            )
    assert chat[0].usage.completion_tokens == 0  # the role chunk comes first
    assert all(ch.usage is None for ch in plain)


def test_user_is_logged_with_the_request_id_and_bounded(tiny_model, caplog):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            ok = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "user": "alice\nbob"})
            long = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "user": "u" * 257})
            typed = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "user": 7})
        return ok, long, typed

    with caplog.at_level(logging.INFO, logger="shoal.router.fronts.openai_app"):
        ok, long, typed = asyncio.run(main())
    assert ok.status_code == 200
    assert f"request {ok.json()['id']} from user 'alice\\nbob'" in caplog.messages
    for r in (long, typed):
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"


def test_tokenize_is_the_engines_tokens_and_detokenize_round_trips(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:
            text = (await c.post("/tokenize", json={"model": fe.info.model, "prompt": PROMPT})).json()
            plain = (await c.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})).json()
            chat = (await c.post("/tokenize", json={"messages": MESSAGES})).json()
            back = (await c.post("/detokenize", json={"tokens": text["tokens"]})).json()
        return fe, text, plain, chat, back

    fe, text, plain, chat, back = asyncio.run(main())
    tok = fe.tokenizer
    assert text["tokens"] == tok.encode(PROMPT) and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == fe.info.max_model_len
    assert plain["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert back == {"prompt": tok.decode(text["tokens"], skip_special_tokens=False)}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"prompt": "word " * 200}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1] * 100}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 2}, "echo"),
        ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
            "continuous_usage_stats",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(tiny_model, path, body, param):
    async def main():
        fe = make_frontend(tiny_model, max_model_len=64)
        async with http_client(fe) as c:
            bad = await c.post(path, json=body)
            good = await c.post("/tokenize", json={"prompt": PROMPT})
        return bad, good

    bad, good = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert good.status_code == 200


def test_tokenize_is_guarded_like_the_completions(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, api_key="sekret")
        key = {"Authorization": "Bearer sekret"}
        async with http_client(fe, max_request_bytes=1000) as c:
            out = [
                await c.post("/tokenize", json={"prompt": "hi"}),
                await c.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer wrong"}),
                await c.post("/tokenize", json={"prompt": "hi"}, headers=key),
                await c.post("/detokenize", json={"tokens": [1]}, headers=key),
                await c.post("/tokenize", json={"prompt": "x" * 2000}, headers=key),
                await c.post("/tokenize", content=b"prompt=hi", headers=key),
                await c.post("/tokenize", json={"prompt": "hi", "model": "gpt-9"}, headers=key),
            ]
        async with http_client(fe, allowed_hosts=("localhost",)) as c:
            out.append(await c.post("/detokenize", json={"tokens": [1]}, headers=key))
        return out

    r = asyncio.run(main())
    assert [x.status_code for x in r] == [401, 401, 200, 200, 413, 415, 404, 400]
    assert r[-1].json()["error"]["code"] == "invalid_host"
