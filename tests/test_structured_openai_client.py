"""Slow tier: structured output and tool calling through the official openai
client, against a local cluster serving the default model (SmolLM2-135M-Instruct)
with --tool-call-parser hermes. Greedy throughout, so streamed and whole agree."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serving import local_cluster_app

from shoal.router.fronts.tools import parse_messages
from shoal.workers.model_executor.loader.model_loader import load_model_files

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0, max_tokens=80)
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ID = re.compile(r"call_[A-Za-z0-9]{24}")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    job: Literal["doctor", "teacher", "farmer", "other"]


@pytest.fixture(scope="module")
def server():
    with local_cluster_app(
        "shoal-structured", num_workers=1, num_threads=2, num_kv_blocks=256, tool_call_parser="hermes"
    ) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_json_schema_json_object_and_parse(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    msgs = [{"role": "user", "content": "Describe the capital of France as JSON."}]
    r = client.chat.completions.create(model=model, messages=msgs, response_format=fmt, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)

    msgs = [{"role": "user", "content": 'Reply with a JSON object {"answer": ...}: what is 2 + 2?'}]
    r = client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    msgs = [{"role": "user", "content": "Invent a person: name, age and job."}]
    parsed = client.chat.completions.parse(model=model, messages=msgs, response_format=Person, **GREEDY)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_calls_whole_and_streamed(client, model, choice):
    args = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, **GREEDY)
    whole = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as s:
        final = s.get_final_completion()
    w = whole.choices[0]
    assert w.message.tool_calls and all(ID.fullmatch(c.id) for c in w.message.tool_calls)
    for name, arguments in _calls(w.message):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if choice == "required":
        assert w.finish_reason == "tool_calls"
    else:
        assert w.finish_reason == "tool_calls" and [n for n, _ in _calls(w.message)] == ["get_weather"]
    assert _calls(final.choices[0].message) == _calls(w.message)
    assert final.choices[0].finish_reason == w.finish_reason


def test_auto_round_trip_with_a_tool_reply(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, **GREEDY)
    msg = first.choices[0].message
    for name, arguments in _calls(msg):  # SmolLM2 may or may not write a Hermes call
        assert name in SCHEMAS and isinstance(json.loads(arguments), dict)
    assert (first.choices[0].finish_reason == "tool_calls") == bool(msg.tool_calls)
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, **GREEDY)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls


def test_tokenize_equals_the_engines_tokens(server, client, model):
    history = ASK + [{"role": "assistant", "content": "Let me check."}]
    tok = load_model_files(None).tokenizer
    want = tok.encode(tok.apply_chat_template(parse_messages(history), tools=TOOLS), add_special_tokens=False)
    got = httpx.post(server + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60).json()
    assert got["tokens"] == want
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == len(want)
