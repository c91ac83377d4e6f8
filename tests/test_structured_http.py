"""Structured output on the OpenAI HTTP front over a real Worker and the tiny
random model: response_format, vLLM's structured_outputs and guided_* fields
constrain the reply, and every spec the grammar library refuses is a 400
naming its field, with the server still serving."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from serving import http_client, make_frontend

from shoal.proto.structured_params import StructuredOutputsParams
from shoal.router.fronts.frontend import ServingError
from shoal.workers import SamplingParams

MESSAGES = [{"role": "user", "content": "Describe a person."}]
# Bounded everywhere: a random model never closes an unbounded string.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "tags", "home"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _events(body: str) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in body.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _streamed_text(body: str, chat: bool) -> str:
    key = "content"
    return "".join(
        (c["choices"][0]["delta"].get(key) or "") if chat else c["choices"][0]["text"]
        for c in _events(body)
        if c["choices"]
    )


def test_json_schema_replies_validate_for_every_seed_whole_and_streamed(tiny_model):
    seeds = range(12)

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        body = {"messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "response_format": JSON_SCHEMA}
        async with http_client(fe) as c:
            whole = await asyncio.gather(*(c.post("/v1/chat/completions", json=dict(body, seed=s)) for s in seeds))
            streamed = await c.post("/v1/chat/completions", json=dict(body, seed=3, stream=True))
        return [r.json() for r in whole], streamed

    whole, streamed = asyncio.run(main())
    replies = [r["choices"][0]["message"]["content"] for r in whole]
    for r, text in zip(whole, replies):
        assert r["choices"][0]["finish_reason"] == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(replies)) > 1  # the seeds sampled, the grammar only bounded them
    assert _streamed_text(streamed.text, chat=True) == replies[3]


def test_regex_choice_grammar_and_every_spelling_on_both_endpoints(tiny_model):
    regex = r"[a-d]{3}-[0-9]{2}"
    grammar = 'start: "ok " word\nword: "yes" | "no" | "maybe"'
    cases = [  # (endpoint, extra fields, check of the reply)
        ("chat", {"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
        ("chat", {"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ("chat", {"structured_outputs": {"grammar": grammar}}, lambda t: t in ("ok yes", "ok no", "ok maybe")),
        # vLLM's own backend knobs are accepted and change nothing here
        (
            "chat",
            {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True, "whitespace_pattern": " "}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        (
            "chat",
            {"structured_outputs": {"json": json.dumps(PERSON)}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        ("text", {"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
        ("text", {"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ("text", {"guided_grammar": grammar, "guided_decoding_backend": "xgrammar"}, lambda t: t.startswith("ok ")),
        ("text", {"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ("text", {"response_format": JSON_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ("chat", {"response_format": {"type": "text"}, "max_tokens": 5}, lambda t: isinstance(t, str)),
        ("chat", {"response_format": {"type": "json_object"}, "max_tokens": 3}, lambda t: t.startswith("{")),
    ]

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        out = []
        async with http_client(fe) as c:
            for kind, extra, _ in cases:
                body = {"max_tokens": 200, "temperature": 1.0, "seed": 7, **extra}
                if kind == "chat":
                    r = await c.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
                    s = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **body})
                    out.append((r, r.json()["choices"][0]["message"]["content"], _streamed_text(s.text, True)))
                else:
                    r = await c.post("/v1/completions", json={"prompt": "Answer:", **body})
                    s = await c.post("/v1/completions", json={"prompt": "Answer:", "stream": True, **body})
                    out.append((r, r.json()["choices"][0]["text"], _streamed_text(s.text, False)))
        return out

    for (_, extra, check), (r, text, streamed) in zip(cases, asyncio.run(main())):
        assert r.status_code == 200, (extra, r.text)
        assert check(text), (extra, text)
        assert streamed == text, extra  # the same seed streamed
        if "max_tokens" not in extra:
            assert r.json()["choices"][0]["finish_reason"] == "stop", (extra, text)


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}},
            "response_format",
            "$ref cycle",
        ),
        ({"guided_json": {"type": "object", "if": {"required": ["a"]}}}, "guided_json", "if"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs", "objectx"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
        ({"guided_regex": "[z-a]"}, "guided_regex", "regex"),
        ({"guided_grammar": "start: ::= 'a'"}, "guided_grammar", "grammar"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "grammar"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "response_format"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
        ({"structured_outputs": "a+"}, "structured_outputs", "object"),
        ({"guided_choice": "a"}, "guided_choice", "choice"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": "json_object"}, "response_format", "object"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
            "response_format",
            "strict",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
    ],
)
def test_a_refused_spec_is_a_400_naming_its_field_and_the_server_keeps_serving(tiny_model, body, param, words):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            bad = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body})
            good = await c.post(
                "/v1/chat/completions",
                json={"messages": MESSAGES, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
            )
        return bad, good, fe

    bad, good, fe = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert fe.num_in_flight == 0


def test_completions_refuse_a_bad_spec_the_same_way(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            return await c.post("/v1/completions", json={"prompt": "x", "guided_json": {"type": "object", "if": {}}})

    r = asyncio.run(main())
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"


def test_a_grammar_past_the_compile_timeout_is_a_400_naming_the_field(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        fe.info.grammar_compile_timeout_s = 0  # no check can finish in no time
        async with http_client(fe) as c:
            return await c.post("/v1/completions", json={"prompt": "x", "guided_regex": "[ab]+"})

    r = asyncio.run(main())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and "--grammar-compile-timeout-s" in err["message"]


def test_a_workers_refusal_comes_back_as_invalid_naming_the_field(tiny_model):
    """The router checks a spec first; one that reaches a worker anyway (an older
    router, another front) is refused there with the same kind and field."""

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        bad = SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a(b", field="guided_regex")
        )
        with pytest.raises(ServingError) as err:
            async for _ in fe.generate([5, 6, 7], bad, "bad-1"):
                pass
        ok = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=("yes",)))
        texts = [d.text async for d in fe.generate([5, 6, 7], ok, "good-1")]
        return err.value, "".join(texts)

    err, text = asyncio.run(main())
    assert (err.kind, err.field) == ("invalid", "guided_regex") and "regex" in err.message
    assert text == "yes"
