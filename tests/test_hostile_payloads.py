"""The payloads of the second security review, one after another against a
router as clients reach it (uvicorn on a real port and the gRPC server, on
the router's one event loop, over two in-process workers on a tiny model),
while idle half-open connections are held and /health is polled every 0.2 s.
Each answer is a 4xx or a 200 (a stream ends with [DONE]), never a 5xx;
gRPC's is INVALID_ARGUMENT; the workers' engines are the same after each,
and a normal request completes after each. /health answers 200 within 1 s
every time: the one timing bound here, with a wide margin (each payload's
cost grows with it on the loop, which is what it once froze for seconds to
minutes). Run: pytest -m slow tests/test_hostile_payloads.py"""

from __future__ import annotations

import json
import socket

import grpc
import httpx
import pytest
from live_router import KEY, HealthWatch, LiveRouter

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {KEY}"}
ZEROS = "0٠۰߀०০੦૦୦௦౦೦൦๐໐༠၀႐០᠐"  # ASCII's and other scripts' zero digits
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "save",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Save a note"}]


def _ref_pointers(n: int) -> dict:
    """Properties that name one node through n pointers spelt with other scripts' zeros."""
    props = {f"p{k}": {"$ref": "#/$defs/L/" + ZEROS[k % len(ZEROS)] * (1 + k // len(ZEROS))} for k in range(n)}
    return {"type": "object", "properties": props, "$defs": {"L": [{"type": "string"}]}}


def _cyclic(n: int) -> dict:
    """A chain of n definitions each naming the next, the last naming the first."""
    defs = {f"d{k}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{(k + 1) % n}"}}} for k in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.fixture(scope="module")
def router(tiny_model):
    r = LiveRouter(tiny_model, max_model_len=256).start()
    yield r
    r.stop()


def _payloads(byte_token: int) -> list[tuple[str, str, dict]]:
    """(what, path, body): each of the review's HTTP payloads."""
    prompt = "Tell me a story"
    return [
        ("$ref through Unicode zeros", "/v1/completions", {"prompt": prompt, "structured_outputs": {"json": _ref_pointers(400)}}),
        ("a cyclic $ref chain", "/v1/completions", {"prompt": prompt, "structured_outputs": {"json": _cyclic(2000)}}),
        ("100,000 [", "/v1/completions", {"prompt": prompt, "structured_outputs": {"json": "[" * 100_000}}),
        ("100,000 [ as a schema", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "[" * 100_000}}}),
        ("$ref ending in ²", "/v1/completions", {"prompt": prompt, "structured_outputs": {"json": {"$ref": "#/$defs/L/²", "$defs": {"L": [{}]}}}}),
        ("32,000 logit_bias over 64 x n 16", "/v1/completions", {"prompt": [prompt] * 64, "n": 16, "max_tokens": 4, "logit_bias": {str(t): 1 for t in range(32_000)}}),
        ("64 prompts x n 16", "/v1/completions", {"prompt": [prompt] * 64, "n": 16, "max_tokens": 4}),
        ("chat n 16 without max_tokens", "/v1/chat/completions", {"messages": MESSAGES, "n": 16}),
        ("a required tool call, streamed", "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "stream": True}),
        ("a malformed hermes call, streamed", "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "stream": True, "structured_outputs": {"regex": '<tool_call>\\{"name": tru\\}</tool_call>'}}),
        ("a malformed hermes call", "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "structured_outputs": {"regex": "<tool_call>not json</tool_call>"}}),
        ("a million empty objects (3 MB)", "/v1/completions", {"prompt": [{}] * 1_000_000}),
        ("100,000 messages (3 MB)", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 100_000, "max_tokens": 1}),
        ("invalid UTF-8 forced by logit_bias, streamed", "/v1/completions", {"prompt": prompt, "max_tokens": 200, "logit_bias": {str(byte_token): 100}, "stream": True}),
    ]  # fmt: skip


def _byte_token(tokenizer, vocab_size: int) -> int:
    """A token whose text alone is not UTF-8 (a lone continuation byte)."""
    for t in range(vocab_size):
        if tokenizer.decode([t]) == "\ufffd":
            return t
    raise AssertionError("the tiny model's tokenizer has no byte token")


def _half_open(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(s)
    return socks


def _normal_request_completes(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_each_payload_is_a_4xx_or_a_200_and_health_keeps_answering(router):
    payloads = _payloads(_byte_token(router.fe.tokenizer, router.fe.info.vocab_size))
    held = _half_open(router.http_port, 16)
    answers = {}
    try:
        with (
            HealthWatch(f"{router.base}/health") as watch,
            httpx.Client(base_url=router.base, headers=AUTH, timeout=300) as client,
        ):
            _normal_request_completes(client)
            for what, path, body in payloads:
                with client.stream("POST", path, json=body) as r:
                    text = r.read().decode()
                answers[what] = r.status_code
                assert r.status_code == 200 or 400 <= r.status_code < 500, (what, r.status_code, text[:300])
                if r.status_code == 200 and body.get("stream"):
                    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
                    assert events[-1] == "data: [DONE]", (what, text[-300:])
                    assert not any('"error"' in e for e in events), (what, text[-600:])
                elif r.status_code != 200:
                    assert json.loads(text)["error"]["message"], what
                assert router.engines_alive() == [], what
                _normal_request_completes(client)
    finally:
        for s in held:
            s.close()
    # The refusals the review asked for, named by field; the rest served.
    for what in ("$ref through Unicode zeros", "a cyclic $ref chain", "100,000 [", "$ref ending in ²"):
        assert answers[what] == 400, (what, answers[what])
    assert answers["32,000 logit_bias over 64 x n 16"] == 400 and answers["64 prompts x n 16"] == 400
    assert answers["chat n 16 without max_tokens"] == 200 and answers["a million empty objects (3 MB)"] == 400
    assert answers["a malformed hermes call"] == 200 and answers["a malformed hermes call, streamed"] == 200
    assert len(watch.answers) >= 5 and watch.problems() == [], watch.problems()


def test_the_payloads_over_grpc_are_invalid_argument(router):
    channel = grpc.insecure_channel(router.grpc_target)
    stub = shoal_pb2_grpc.ShoalStub(channel)
    meta = (("authorization", f"Bearer {KEY}"),)
    bad = [
        ("$ref through Unicode zeros", json.dumps(_ref_pointers(400))),
        ("100,000 [", "[" * 100_000),
        ("$ref ending in ²", json.dumps({"$ref": "#/$defs/L/²", "$defs": {"L": [{}]}})),
    ]
    try:
        with HealthWatch(f"{router.base}/health") as watch:
            for what, schema in bad:
                req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4, json_schema=schema))
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(req, metadata=meta, timeout=120))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value.details())
            sp = pb.SamplingParams(max_tokens=4)
            for t in range(301):
                sp.logit_bias[t] = 1.0
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=sp), metadata=meta, timeout=120))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()
            ok = list(
                stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3)), metadata=meta)
            )
            assert sum(len(m.token_ids) for m in ok) == 3
        assert router.engines_alive() == [] and watch.problems() == [], watch.problems()
    finally:
        channel.close()
