"""Malformed tool calls from the model, end to end: the tiny model is made to
write them (a regex beside tool_choice auto), and each front answers 200 with
the text as plain content and the engine's finish, the stream ends in [DONE],
gRPC ends OK; a normal request is served after."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from serving import http_client, make_frontend
from test_grpc_structured import drain, text_of

from shoal.cluster.options import ServeOptions
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.grpc_server import GrpcServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
# (--tool-call-parser, what the model writes): each is not a call, and no call's name goes out before that shows
CASES = [
    ("hermes", '<tool_call>{"name": 1}</tool_call>'),
    ("hermes", '<tool_call>{"name": tru}</tool_call>'),  # json.loads raised here: a 500
    ("hermes", 'Hi <tool_call>{"name": "get_wea'),  # unterminated
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"a": [}]}, "name": "f"}</tool_call>'),  # nested junk
    ("pythonic", '[get weather(city="Paris")]'),  # bad syntax
    ("llama3_json", "[1, 2]"),  # a list of non-objects
    ("llama3_json", '{"name": 1.2.3}'),  # json.loads raised here
]
_META = set("\\.^$|?*+()[]{}")


def _literal(text: str) -> str:
    """A regex matching exactly `text` (only the metacharacters escaped, as the grammar's regex wants)."""
    return "".join("\\" + c if c in _META else c for c in text)


def _sse(body: str) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in body.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", body[-200:]
    return [json.loads(ln) for ln in lines[:-1]]


def test_malformed_calls_are_plain_content_over_http_whole_and_streamed(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        out = []
        for parser, text in CASES:
            body = {
                "messages": MESSAGES,
                "tools": TOOLS,
                "max_tokens": 200,
                "structured_outputs": {"regex": _literal(text)},
            }
            async with http_client(fe, tool_call_parser=parser) as c:
                whole = await c.post("/v1/chat/completions", json=body)
                streamed = await c.post("/v1/chat/completions", json=dict(body, stream=True))
                after = await c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
            out.append((text, whole, streamed, after))
        return out

    for text, whole, streamed, after in asyncio.run(main()):
        assert whole.status_code == 200, (text, whole.text)
        (choice,) = whole.json()["choices"]
        assert choice["message"]["content"] == text and not choice["message"].get("tool_calls"), (text, choice)
        assert choice["finish_reason"] == "stop"
        assert streamed.status_code == 200
        chunks = _sse(streamed.text)
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert not any("tool_calls" in d for d in deltas), (text, deltas)
        assert "".join(d.get("content") or "" for d in deltas) == text
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "stop"
        assert after.status_code == 200


@pytest.mark.parametrize("parser", sorted({p for p, _ in CASES}))
def test_malformed_calls_are_plain_content_over_grpc(tiny_model, parser):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        server = GrpcServer(fe, "127.0.0.1", 0, ServeOptions().max_request_bytes, tool_call_parser=parser)
        await server.start()
        tools = [pb.Tool(function=pb.FunctionDefinition(name="get_weather", parameters_json='{"type": "object"}'))]
        user = pb.ChatMessage(role="user", content="What is the weather?")
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                for p, text in CASES:
                    if p != parser:
                        continue
                    sampling = pb.SamplingParams(max_tokens=200, regex=_literal(text))
                    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[user]), tools=tools, sampling=sampling)
                    out.append((text, await drain(stub.Generate(req))))  # an error status raises here
                ok = await drain(stub.Generate(pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=4))))
        finally:
            await server.stop(0)
        return out, ok

    out, ok = asyncio.run(main())
    assert len(out) == sum(p == parser for p, _ in CASES)
    for text, msgs in out:
        assert text_of(msgs) == text
        assert not any(m.tool_calls for m in msgs)
        assert msgs[-1].finished.finish_reason == "stop"
    assert ok[-1].finished.finish_reason in ("stop", "length")
