"""shoal.v1.Shoal fuzzed with hypothesis over the proto's own fields: every
GenerateRequest and TokenizeRequest field drawn from its descriptor (ints at
their extremes, floats with NaN and infinities, unicode and huge strings,
repeated and map fields, each oneof's members or none), a bounded,
derandomized number of each, sent by the generated stubs to the real gRPC
server on the router's event loop over two in-process workers. Every call
ends OK (each choice's stream finished) or with a client's status, never
UNKNOWN or INTERNAL; no worker's engine fails; /health, polled every 0.2 s,
answers 200 within 1 s throughout. Run: pytest -m slow tests/test_fuzz_grpc.py"""

from __future__ import annotations

import collections
import logging
import math
import os

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_router import KEY, HealthWatch, LiveRouter

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc

pytestmark = pytest.mark.slow
AUTH = (("authorization", f"Bearer {KEY}"),)
SCALE = int(os.environ.get("SHOAL_FUZZ_SCALE", "1"))  # 10 for a longer run before a release
GENERATE_EXAMPLES, TOKENIZE_EXAMPLES = 200 * SCALE, 40 * SCALE  # about 30 s on two cores
# What a client's mistake may end in; UNKNOWN and INTERNAL are the server's own faults, UNAVAILABLE a lost worker.
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}

_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)  # proto strings are UTF-8: no lone surrogates
# A huge one now and then, within the 4 MiB message limit alone, past it with a few others (RESOURCE_EXHAUSTED).
STRINGS = st.one_of(_text, _text, _text, st.sampled_from(["", "hi", "\x00", "é😀", "\u202e"]), st.just("x" * 1_500_000))
SCALARS = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1) | st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, -1, 2**63 - 1, -(2**63)]),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32) | st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -0.0]),
    FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: STRINGS,
}
_SCHEMA = '{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]}'
# Plausible values beside the generic ones, so that many requests pass the checks and run on the engines.
HINTS = {
    "shoal.v1.GenerateRequest.text": st.sampled_from(["hi", "The quick brown fox"]),
    "shoal.v1.TokenizeRequest.text": st.sampled_from(["hi", "The quick brown fox"]),
    "shoal.v1.TokenIds.ids": st.integers(0, 600),
    "shoal.v1.ChatMessage.role": st.sampled_from(["user", "assistant", "system", "tool"]),
    "shoal.v1.SamplingParams.max_tokens": st.integers(-2, 40),
    "shoal.v1.SamplingParams.n": st.integers(-1, 5),
    "shoal.v1.SamplingParams.temperature": st.floats(0, 2),
    "shoal.v1.SamplingParams.top_k": st.integers(-2, 50),
    "shoal.v1.SamplingParams.logprobs": st.integers(-1, 25),
    "shoal.v1.SamplingParams.json_schema": st.sampled_from([_SCHEMA, "[" * 10_000, '{"$ref": "#/x/²"}', "{}"]),
    "shoal.v1.SamplingParams.regex": st.sampled_from(["[a-z]+", "(", "a{99999}"]),
    "shoal.v1.SamplingParams.grammar": st.sampled_from(['start: "a"+', "start: ", "?"]),
    "shoal.v1.SamplingParams.stop_token_ids": st.integers(-1, 600),
    "shoal.v1.FunctionDefinition.name": st.sampled_from(["get_weather", "f", "bad name"]),
    "shoal.v1.FunctionDefinition.parameters_json": st.sampled_from([_SCHEMA, "", "not json", "[" * 5000]),
    "shoal.v1.FunctionCall.arguments": st.sampled_from(['{"a": "b"}', "", "{", "[" * 5000]),
    "shoal.v1.GenerateRequest.tool_choice": st.sampled_from(["", "none", "auto", "required"]),
    "shoal.v1.GenerateRequest.tool_choice_function": st.sampled_from(["", "get_weather", "f"]),
    "shoal.v1.GenerateRequest.priority": st.sampled_from([0, 0, 0, 1, -(2**31)]),
    "shoal.v1.GenerateRequest.lora": st.sampled_from(["", "", "no-such-adapter"]),
}


def field_values(f: FieldDescriptor, depth: int) -> st.SearchStrategy:
    """One value of `f` (a list for a repeated field, a dict for a map)."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(_single(key, depth), _single(value, depth), max_size=5)
    one = _single(f, depth)
    if f.is_repeated:
        if f.message_type is not None or f.type == FieldDescriptor.TYPE_STRING:
            return st.lists(one, max_size=4)
        return st.lists(one, max_size=4) | st.lists(one, min_size=1000, max_size=1000)  # long runs of numbers
    return one


def _single(f: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if f.message_type is not None:
        return messages(f.message_type, depth + 1)
    generic = SCALARS[f.type]
    hint = HINTS.get(f.full_name)
    return generic if hint is None else hint | hint | generic  # the hint twice as often


def messages(desc, depth: int = 0) -> st.SearchStrategy:
    """A message of type `desc`: each oneof (proto3 `optional` ones included)
    set to one of its members or none; every other field set or left unset."""
    cls = message_factory.GetMessageClass(desc)

    @st.composite
    def build(draw):
        chosen = {o.name: draw(st.sampled_from([None, *o.fields])) for o in desc.oneofs}
        kwargs = {}
        for f in desc.fields:
            if f.containing_oneof is not None:
                if chosen[f.containing_oneof.name] is not f:
                    continue
            elif not draw(st.booleans()):
                continue
            if f.message_type is not None and depth >= 3 and f.is_repeated:
                continue  # deep enough
            kwargs[f.name] = draw(field_values(f, depth))
        return cls(**kwargs)

    return build()


@pytest.fixture(scope="module")
def router(tiny_model):
    r = LiveRouter(tiny_model, max_model_len=64).start()  # a short context: every request ends quickly
    yield r
    r.stop()


def test_generate_and_tokenize_fuzzed_over_the_proto_end_ok_or_with_a_client_status(router):
    codes: collections.Counter = collections.Counter()
    logging.getLogger("shoal").setLevel(logging.ERROR)  # a refusal per example is the point here, not news
    channel = grpc.insecure_channel(router.grpc_target, options=[("grpc.max_receive_message_length", 64 << 20)])
    stub = shoal_pb2_grpc.ShoalStub(channel)
    common = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

    @settings(max_examples=GENERATE_EXAMPLES, **common)
    @given(request=messages(pb.GenerateRequest.DESCRIPTOR))
    def generate(request):
        finished: set[int] = set()
        try:
            for msg in stub.Generate(request, metadata=AUTH, timeout=60):
                if msg.HasField("finished"):
                    finished.add(msg.index)
        except grpc.RpcError as e:
            codes[e.code()] += 1
            assert e.code() in CLIENT_CODES, (e.code(), e.details(), request)
            return
        codes[grpc.StatusCode.OK] += 1
        n = request.sampling.n if request.sampling.HasField("n") else 1
        assert finished == set(range(n)), (finished, request)  # every choice ended: no stream was cut

    @settings(max_examples=TOKENIZE_EXAMPLES, **common)
    @given(request=messages(pb.TokenizeRequest.DESCRIPTOR))
    def tokenize(request):
        try:
            r = stub.Tokenize(request, metadata=AUTH, timeout=60)
        except grpc.RpcError as e:
            codes[e.code()] += 1
            assert e.code() in CLIENT_CODES, (e.code(), e.details(), request)
            return
        codes[grpc.StatusCode.OK] += 1
        assert r.count == len(r.token_ids)

    try:
        with HealthWatch(f"{router.base}/health") as watch:
            generate()
            tokenize()
        assert not router.engines_alive(), router.engines_alive()
        assert watch.answers and not watch.problems(), watch.problems()
        # The fuzzer got past the refusals too: requests ran on the engines.
        assert codes[grpc.StatusCode.OK] >= 10 and codes[grpc.StatusCode.INVALID_ARGUMENT] >= 10, codes
        # A normal request is served after all that.
        out = list(
            stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)), metadata=AUTH)
        )
        assert out[-1].finished.finish_reason in ("stop", "length")
    finally:
        channel.close()
