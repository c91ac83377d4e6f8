"""The gRPC front's tools: chat turns with tool calls and tool replies rendered
as the chat template gets them, tool_choice none / auto / required / a named
function, and the calls read from each choice's reply onto its last message."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import grpc
import jsonschema
import pytest
from serving import make_frontend
from test_grpc_structured import PROMPT, assert_invalid, drain, serve, text_of

from shoal.cluster.options import ServeOptions
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.workers import LLM, SamplingParams


def _chat(*messages: pb.ChatMessage, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=list(messages)), **kw)


USER = pb.ChatMessage(role="user", content="What is the weather in Paris?")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    pb.Tool(
        type="function",
        function=pb.FunctionDefinition(name="get_weather", description="Weather", parameters_json=json.dumps(WEATHER)),
    ),
    pb.Tool(function=pb.FunctionDefinition(name="get_time", parameters_json=json.dumps(TIME))),
]

BAD = [
    (pb.GenerateRequest(text=PROMPT, tools=TOOLS[:1]), "tools"),  # tools need a chat prompt
    (_chat(USER, tools=TOOLS), "tool_choice"),  # auto, and this server has no --tool-call-parser
    (_chat(USER, tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (_chat(USER, tool_choice="required"), "tool_choice"),  # no tools
    (_chat(USER, tools=TOOLS, tool_choice_function="get_news"), "tool_choice_function"),
    (_chat(USER, tools=TOOLS, tool_choice="required", tool_choice_function="get_time"), "tool_choice"),
    (_chat(USER, tools=[pb.Tool(function=pb.FunctionDefinition(name="f", parameters_json="{"))]), "tools"),
    (_chat(USER, tools=[pb.Tool(function=pb.FunctionDefinition(name="bad name"))], tool_choice="none"), "tools"),
    (_chat(USER, tools=TOOLS * 2, tool_choice="required"), "tools"),  # a name defined twice
    (
        _chat(USER, tools=TOOLS, tool_choice="required", sampling=pb.SamplingParams(regex="[a-z]+")),
        "tool_choice",
    ),
    (_chat(USER, pb.ChatMessage(role="tool", content="sunny")), "messages"),  # no tool_call_id
]


def test_bad_tool_fields_are_invalid_argument_naming_the_field(tiny_model):
    assert_invalid(tiny_model, BAD)


# Renders the tool definitions and the calls in the history, as tool-use templates do.
TOOL_TEMPLATE = (
    "{% if tools %}<s>tools: {% for t in tools %}{{ t['function']['name'] }}"
    "{{ t['function']['parameters'] | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}[call {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
    "{% if m.get('tool_call_id') %}[for {{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
HISTORY = [
    USER,
    pb.ChatMessage(
        role="assistant",
        tool_calls=[
            pb.ToolCall(
                id="call_1",
                type="function",
                function=pb.FunctionCall(name="get_weather", arguments='{"city": "Paris"}'),
            )
        ],
    ),
    pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    pb.ChatMessage(role="user", content="And in Rome?"),
]
# The same turns as OpenAI dicts, with a call's arguments as the object the template writes (vLLM's).
HISTORY_DICTS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "user", "content": "And in Rome?"},
]
TOOL_DICTS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


@pytest.fixture(scope="module")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model with a chat template that renders tools and tool calls."""
    path = str(tmp_path_factory.mktemp("tiny-tools"))
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(dict(cfg, chat_template=TOOL_TEMPLATE), f)
    return path


def _calls(msgs, k: int = 0) -> tuple[str, list[pb.ToolCall], pb.Finished]:
    choice = [m for m in msgs if m.index == k]
    assert all(not m.tool_calls for m in choice[:-1])  # the calls ride on the last message only
    return text_of(choice), list(choice[-1].tool_calls), choice[-1].finished


def test_named_and_required_tool_choices_reply_with_valid_calls(tool_model):
    with LLM(tool_model, num_threads=1, num_kv_blocks=256) as llm:
        tok = llm.engine.tokenizer
        rendered = tok.apply_chat_template(HISTORY_DICTS, tools=TOOL_DICTS)
        assert '[call call_1 get_weather {"city": "Paris"}]' in rendered and "[for call_1]" in rendered
        ids = tok.encode(rendered, add_special_tokens=False)
        named_ref = llm.generate(
            ids, SamplingParams(max_tokens=48, temperature=1.0, seed=3, structured_outputs=SO(json=WEATHER))
        )[0]
    named, required, tokenized, _ = serve(
        tool_model,
        [
            _chat(
                *HISTORY,
                tools=TOOLS,
                tool_choice_function="get_weather",
                sampling=pb.SamplingParams(max_tokens=48, temperature=1.0, seed=3),
            ),
            _chat(
                *HISTORY,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                sampling=pb.SamplingParams(n=3, max_tokens=96, temperature=1.0, seed=5),
            ),
            pb.TokenizeRequest(chat=pb.ChatMessages(messages=HISTORY)),
        ],
    )
    # The gRPC front renders the same prompt (tools and the calls in the history) and asks the same grammar.
    text, calls, fin = _calls(named)
    assert [t for m in named for t in m.token_ids] == named_ref.token_ids and fin.usage.prompt_tokens == len(ids)
    assert fin.finish_reason == "tool_calls" and len(calls) == 1
    (call,) = calls
    assert (
        call.type == "function"
        and call.function.name == "get_weather"
        and re.fullmatch("call_[A-Za-z0-9]{24}", call.id)
    )
    assert call.function.arguments == text.strip()
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert list(tokenized.token_ids) == tok.encode(tok.apply_chat_template(HISTORY_DICTS), add_special_tokens=False)
    for k in range(3):
        text, calls, fin = _calls(required, k)
        (item,) = json.loads(text)  # parallel_tool_calls false: one call
        assert fin.finish_reason == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == item["name"] and json.loads(calls[0].function.arguments) == item["parameters"]
        jsonschema.validate(item["parameters"], WEATHER if item["name"] == "get_weather" else TIME)


def test_auto_tool_choice_reads_the_reply_with_the_servers_parser(tool_model):
    """A regex makes the random model write a hermes call; the server's
    --tool-call-parser reads it, and a plain reply stays content."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'

    async def main():
        fe = make_frontend(tool_model, num_threads=1)
        server = GrpcServer(fe, "127.0.0.1", 0, ServeOptions().max_request_bytes, tool_call_parser="hermes")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                forced = await drain(
                    stub.Generate(_chat(USER, tools=TOOLS, sampling=pb.SamplingParams(max_tokens=200, regex=call)))
                )
                plain = await drain(
                    stub.Generate(
                        _chat(USER, tools=TOOLS, tool_choice="auto", sampling=pb.SamplingParams(max_tokens=8))
                    )
                )
        finally:
            await server.stop(0)
        return forced, plain

    forced, plain = asyncio.run(main())
    text, calls, fin = _calls(forced)
    assert re.fullmatch(call, text) and fin.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {"zone": re.search("UTC|CET", text).group()})
    ]
    text, calls, fin = _calls(plain)
    assert "<tool_call>" not in text and not calls and fin.finish_reason in ("stop", "length")
