"""Tool calling on the OpenAI chat endpoint over a real Worker and the tiny
random model: tool_choice required and named are made by the grammar and come
back as tool_calls whose arguments validate, whole and streamed (reassembled
by the official client too); auto goes through the --tool-call-parser; tool
calls in the history reach the chat template as transformers passes them."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import httpx
import jsonschema
import openai
import pytest
from serving import http_client, make_frontend

from shoal.cluster.options import ServeOptions
from shoal.router.fronts.openai_app import OpenAIApp

MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"$ref": "#/$defs/unit"},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
    "$defs": {"unit": {"enum": ["C", "F"]}},  # moved to the root of the required array's schema
}
SEARCH = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 5}, "top": {"type": "boolean"}},
    "required": ["q", "top"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: `{}`
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object", "maxProperties": 0}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ID = re.compile(r"call_[A-Za-z0-9]{24}")
SEEDS = range(8)
HERMES = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
)


def _body(**kw) -> dict:
    return {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, **kw}


def _events(body: str) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in body.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _reassemble(body: str) -> dict:
    """A streamed reply's content, calls and finish_reason, checking each
    piece's shape: a call's first piece has index, id, type and name with
    empty arguments; later ones only argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in _events(body):
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def test_required_and_named_are_tool_calls_whose_arguments_validate_whole_and_streamed(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            post = c.post
            required = await asyncio.gather(
                *(post("/v1/chat/completions", json=_body(tool_choice="required", seed=s)) for s in SEEDS)
            )
            named = await asyncio.gather(
                *(post("/v1/chat/completions", json=_body(tool_choice=NAMED, seed=s)) for s in SEEDS)
            )
            streamed = {
                (kind, s): await post("/v1/chat/completions", json=_body(tool_choice=choice, seed=s, stream=True))
                for kind, choice in (("required", "required"), ("named", NAMED))
                for s in SEEDS[:3]
            }
        return [r.json() for r in required], [r.json() for r in named], streamed

    required, named, streamed = asyncio.run(main())
    names = set()
    for r in required:
        (choice,) = r["choices"]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] == "", choice
        assert msg["tool_calls"]
        for call in msg["tool_calls"]:
            assert ID.fullmatch(call["id"]) and call["type"] == "function"
            names.add(call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len(names) > 1  # the model chose among the tools
    for r in named:
        (choice,) = r["choices"]
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls"  # every reply that ends in calls says so
        assert call["function"]["name"] == "get_weather" and ID.fullmatch(call["id"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    for (kind, s), resp in streamed.items():
        whole = (required if kind == "required" else named)[s]["choices"][0]
        got = _reassemble(resp.text)
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == _calls(whole["message"]), kind
        assert got["finish_reason"] == whole["finish_reason"] and got["content"] == ""
        assert all(ID.fullmatch(c["id"]) for c in got["calls"])


def test_without_parallel_tool_calls_required_makes_exactly_one_call(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            return await asyncio.gather(
                *(
                    c.post(
                        "/v1/chat/completions", json=_body(tool_choice="required", parallel_tool_calls=False, seed=s)
                    )
                    for s in SEEDS
                )
            )

    for r in asyncio.run(main()):
        assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_the_official_client_reassembles_the_stream_into_the_whole_reply(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        app = OpenAIApp(fe, ServeOptions().max_request_bytes).app
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shoal")
        out = []
        async with openai.AsyncOpenAI(base_url="http://shoal/v1", api_key="x", http_client=http, max_retries=0) as c:
            for choice in ("required", NAMED):
                args = dict(model=fe.info.model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=5)
                args.update(max_tokens=200, temperature=1.0)
                whole = await c.chat.completions.create(**args)
                async with c.chat.completions.stream(**args) as s:
                    async for _ in s:
                        pass
                    out.append((whole, await s.get_final_completion()))
        return out

    for whole, final in asyncio.run(main()):
        w, f = whole.choices[0], final.choices[0]
        assert w.message.tool_calls and f.message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in f.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in w.message.tool_calls
        ]
        assert f.finish_reason == w.finish_reason


def test_each_choice_of_n_is_read_for_its_own_calls(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            body = _body(tool_choice="required", seed=11, n=3)
            return (await c.post("/v1/chat/completions", json=body)).json(), await c.post(
                "/v1/chat/completions", json=dict(body, stream=True)
            )

    whole, streamed = asyncio.run(main())
    chunks = _events(streamed.text)
    for choice in whole["choices"]:
        i = choice["index"]
        mine = "".join(
            "data: " + json.dumps(ch) + "\n\n" for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i
        )
        got = _reassemble(mine + "data: [DONE]\n\n")
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == _calls(choice["message"])
        for name, args in _calls(choice["message"]):
            jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_auto_reads_the_reply_with_the_tool_call_parser(tiny_model):
    """The tiny model is made to write a Hermes call (a regex beside tool_choice
    auto, which vLLM allows too); the hermes parser turns it into tool_calls."""

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        body = _body(structured_outputs={"regex": HERMES}, seed=2)
        async with http_client(fe, tool_call_parser="hermes") as c:
            whole = (await c.post("/v1/chat/completions", json=body)).json()
            streamed = await c.post("/v1/chat/completions", json=dict(body, stream=True))
            plain = (await c.post("/v1/chat/completions", json=_body(max_tokens=6, seed=2))).json()
        async with http_client(fe) as c:  # no parser: auto is refused, required is not
            refused = await c.post("/v1/chat/completions", json=_body(max_tokens=4))
            required = await c.post("/v1/chat/completions", json=_body(tool_choice="required"))
        return whole, streamed, plain, refused, required

    whole, streamed, plain, refused, required = asyncio.run(main())
    (choice,) = whole["choices"]
    (name, args), *more = _calls(choice["message"])
    assert not more and name == "get_weather" and json.loads(args)["city"] in ("Paris", "Rome")
    assert choice["message"]["content"] == "Sure. " and choice["finish_reason"] == "tool_calls"
    got = _reassemble(streamed.text)
    assert got["content"] == "Sure. " and [(c["name"], c["arguments"]) for c in got["calls"]] == [(name, args)]
    assert got["finish_reason"] == "tool_calls"
    # no call in the reply: plain content, the engine's finish
    assert "tool_calls" not in plain["choices"][0]["message"] and plain["choices"][0]["finish_reason"] == "length"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in refused.json()["error"]["message"]
    assert required.status_code == 200


# A template that writes what tool-use templates (Qwen 2.5, Hermes, Llama 3.1) read.
TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }};{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": ""}},
            {"id": "call_3", "type": "function", "function": {"name": "search", "arguments": "not json"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]},
]


def test_tools_and_tool_history_reach_the_template_as_transformers_passes_them(tiny_model):
    expected = (
        "TOOLS:" + "".join(json.dumps(t, ensure_ascii=False) + ";" for t in TOOLS) + "user:Weather in Paris?"
        'assistant:[call_1 get_weather {"city": "Paris"}][call_2 ping {}][call_3 search "not json"]'
        "tool:18 C(call_1)"
    )

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        tok = fe.tokenizer = copy.copy(fe.tokenizer)
        tok.chat_template, tok._template = TEMPLATE, None
        async with http_client(fe) as c:
            ids = (await c.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS})).json()["tokens"]
            served = await c.post(
                "/v1/chat/completions", json=_body(messages=HISTORY, tool_choice=NAMED, max_tokens=200)
            )
        return tok, ids, served

    tok, ids, served = asyncio.run(main())
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": None, "tool_choice": NAMED}, "tool_choice"),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": ["f"]}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": [{"function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]}, "messages"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}]},
            "messages",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}]}, "messages"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
            "messages",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {"name": "f"}}]}]},
            "messages",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_field_and_the_server_keeps_serving(tiny_model, body, param):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            bad = await c.post("/v1/chat/completions", json={**_body(tool_choice="required"), **body})
            good = await c.post("/v1/chat/completions", json=_body(tool_choice=NAMED, seed=1))
        return bad, good, fe

    bad, good, fe = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["tool_calls"]
    assert fe.num_in_flight == 0


def test_no_tools_or_none_leave_the_reply_plain(tiny_model):
    """tool_choice none (tools still rendered, as vLLM does), and required of an
    empty tools array (OpenAI's none), give plain text and no tool_calls."""

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            return [
                (await c.post("/v1/chat/completions", json=_body(tool_choice="none", max_tokens=4, seed=1))).json(),
                (
                    await c.post("/v1/chat/completions", json=_body(tools=[], tool_choice="required", max_tokens=4))
                ).json(),
                (
                    await c.post(
                        "/v1/chat/completions", json={"messages": MESSAGES, "tool_choice": "none", "max_tokens": 4}
                    )
                ).json(),
            ]

    for r in asyncio.run(main()):
        (choice,) = r["choices"]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length", r
