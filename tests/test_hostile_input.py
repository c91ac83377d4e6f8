"""Hostile requests over HTTP and gRPC against real tiny workers: each gets
a clear 4xx naming the field (or is served, where vLLM serves it), the
worker's engine stays alive, and a normal request still completes after."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from serving import grpc_server, http_client, make_frontend

from shoal.proto.messages import GenerateRequest
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc

HEADERS = {"Content-Type": "application/json"}
NORMAL = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
BIG = 10**400  # an integer past any float

# (body, expected status, the field the error names; None: any)
HTTP_CASES = {
    # vllm#54195: an out-of-vocabulary stop id banned before min_tokens indexed the logits
    "stop_id_oov_min_tokens": (
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [1000000000]},
        400,
        "stop_token_ids",
    ),
    "stop_id_oov": ({"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    "stop_id_negative": ({"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    "prompt_ids_oov": ({"prompt": [1, 2, 10**9], "max_tokens": 2}, 400, "prompt"),
    "prompt_ids_past_int64": ({"prompt": [1, 2**70], "max_tokens": 2}, 400, "prompt"),
    "logit_bias_oov": ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"1000000000": 5}}, 400, "logit_bias"),
    "logit_bias_not_an_id": ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    "logit_bias_value_range": ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    "logprobs_huge": ({"prompt": "hi", "max_tokens": 2, "logprobs": 10**6}, 400, "logprobs"),
    "logprobs_past_max": ({"prompt": "hi", "max_tokens": 2, "logprobs": 21}, 400, "logprobs"),
    "top_logprobs_past_max": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 10**6},
        400,
        "logprobs",
    ),
    "temperature_nan": ('{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, None),
    "temperature_infinity": ('{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', 400, None),
    "temperature_1e400": ('{"prompt": "hi", "max_tokens": 2, "temperature": 1e400}', 400, None),
    "temperature_10_pow_400": ({"prompt": "hi", "max_tokens": 2, "temperature": BIG}, 400, "temperature"),
    "temperature_past_float32": ({"prompt": "hi", "max_tokens": 2, "temperature": 1e300}, 400, "temperature"),
    "top_p_10_pow_400": ({"prompt": "hi", "max_tokens": 2, "top_p": BIG}, 400, "top_p"),
    "max_tokens_negative": ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    "max_tokens_huge": ({"prompt": "hi", "max_tokens": 2**64}, 400, "max_tokens"),
    "min_tokens_past_max": ({"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    "seed_past_64_bits": ({"prompt": "hi", "max_tokens": 2, "seed": 2**70}, 400, "seed"),
    "presence_penalty_range": ({"prompt": "hi", "max_tokens": 2, "presence_penalty": 3}, 400, "presence_penalty"),
    "repetition_penalty_zero": ({"prompt": "hi", "max_tokens": 2, "repetition_penalty": 0}, 400, "repetition_penalty"),
    "too_many_stop_strings": ({"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    "long_stop_string": ({"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1025]}, 400, "stop"),
    "too_many_stop_ids": ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    "too_many_prompts": ({"prompt": ["hi"] * 65, "max_tokens": 1}, 400, "prompt"),
    "fifty_thousand_prompts": ({"prompt": ["hi"] * 50_000, "max_tokens": 1}, 400, "prompt"),
    "deep_nesting": ('{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
    "top_k_wrong_type": ({"prompt": "hi", "max_tokens": 2, "top_k": "5"}, 400, "top_k"),
    # Served as vLLM serves them: top_k past the vocabulary keeps every token.
    "top_k_2_pow_63": ({"prompt": "hi", "max_tokens": 2, "top_k": 2**63 - 1, "temperature": 1.0}, 200, None),
    "tiny_temperature": ({"prompt": "hi", "max_tokens": 2, "temperature": 1e-300}, 200, None),
}


async def _alive_and_serving(fe, client) -> None:
    for w in fe.pool.workers:
        assert w.engine.failed is None
        w.check_health()
    r = await client.post("/v1/completions", json=NORMAL)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def _post_kwargs(body) -> dict:
    if isinstance(body, str):
        return {"content": body.encode(), "headers": HEADERS}
    return {"content": json.dumps(body).encode(), "headers": HEADERS}


@pytest.fixture(scope="module")
def frontend_factory(tiny_model):
    return lambda: make_frontend(tiny_model, num_workers=2, max_model_len=256)


def test_every_hostile_http_body_gets_its_answer_and_harms_nothing(frontend_factory):
    async def main():
        fe = frontend_factory()
        results = {}
        async with http_client(fe) as client:
            for name, (body, _, _) in HTTP_CASES.items():
                path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
                r = await client.post(path, **_post_kwargs(body))
                results[name] = (r.status_code, r.json())
                await _alive_and_serving(fe, client)
            free = [w.stats() for w in fe.pool.workers]
        return results, free

    results, free = asyncio.run(main())
    for name, (_body, status, field) in HTTP_CASES.items():
        got, payload = results[name]
        assert got == status, (name, got, payload)
        if status == 400:
            assert payload["error"]["type"] == "invalid_request_error", (name, payload)
            if field is not None:
                assert payload["error"]["param"] == field, (name, payload)
                assert field in payload["error"]["message"], (name, payload)
    assert all(s.num_free_blocks == s.num_total_blocks and s.num_running == 0 for s in free)


GRPC_CASES = {
    "stop_id_oov_min_tokens": (dict(max_tokens=4, min_tokens=1, stop_token_ids=[1000000000]), "stop_token_ids"),
    "stop_id_negative": (dict(max_tokens=4, stop_token_ids=[-5]), "stop_token_ids"),
    "logprobs_huge": (dict(max_tokens=2, logprobs=2**31 - 1), "logprobs"),
    "temperature_nan": (dict(max_tokens=2, temperature=float("nan")), "temperature"),
    "temperature_inf": (dict(max_tokens=2, temperature=float("inf")), "temperature"),
    "top_p_nan": (dict(max_tokens=2, top_p=float("nan")), "top_p"),
    "max_tokens_negative": (dict(max_tokens=-3), "max_tokens"),
    "too_many_stop_strings": (dict(max_tokens=2, stop=[f"s{i}" for i in range(65)]), "stop"),
}


def test_every_hostile_grpc_request_gets_invalid_argument_and_harms_nothing(frontend_factory):
    async def main():
        fe = frontend_factory()
        got = {}
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            for name, (sampling, _) in GRPC_CASES.items():
                try:
                    [
                        m
                        async for m in stub.Generate(
                            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling))
                        )
                    ]
                    got[name] = (grpc.StatusCode.OK, "")
                except grpc.aio.AioRpcError as e:
                    got[name] = (e.code(), e.details())
                assert all(w.engine.failed is None for w in fe.pool.workers)
            # top_k past the vocabulary is served (clamped), and a normal request completes
            big_k = [
                m
                async for m in stub.Generate(
                    pb.GenerateRequest(
                        text="hi", sampling=pb.SamplingParams(max_tokens=2, top_k=2**31 - 1, temperature=1.0)
                    )
                )
            ]
            normal = [
                m
                async for m in stub.Generate(
                    pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3, temperature=0))
                )
            ]
        return got, big_k, normal, [w.stats() for w in fe.pool.workers]

    got, big_k, normal, stats = asyncio.run(main())
    for name, (_, field) in GRPC_CASES.items():
        code, details = got[name]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert field in details, (name, details)
    assert big_k[-1].finished.finish_reason == "length"
    assert normal[-1].finished.usage.completion_tokens == 3
    assert all(s.num_free_blocks == s.num_total_blocks for s in stats)


def test_the_engine_refuses_what_the_router_would_have(tiny_model):
    """The engine checks every field itself: a SamplingParams that got past
    (or around) the router, changed after it was made, is refused there too."""
    from shoal.workers import InvalidRequestError, LLMEngine, SamplingParams

    engine = LLMEngine(model=tiny_model, num_kv_blocks=64, max_model_len=256)
    vocab = engine.model_config.vocab_size
    cases = {
        "stop_token_ids": dict(stop_token_ids=[vocab]),
        "logit_bias": dict(logit_bias={vocab + 1: 1.0}),
        "logprobs": dict(logprobs=engine.limits.max_logprobs + 1),
        "temperature": dict(temperature=float("nan")),
        "top_p": dict(top_p=float("inf")),
        "seed": dict(seed=2**64),
        "stop": dict(stop=["x"] * 65),
        "min_tokens": dict(min_tokens=-1),
        "max_tokens": dict(max_tokens=True),
    }
    for field, change in cases.items():
        params = SamplingParams(max_tokens=2)
        for k, v in change.items():
            setattr(params, k, v)  # around the constructor's own check
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(GenerateRequest(f"bad-{field}", [1, 2, 3], params))
        assert e.value.field == field, (field, e.value)
    for bad, field in ((5, "prompt"), ([1, "2"], "prompt"), ([1, 2.5], "prompt")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(GenerateRequest("bad-prompt", engine.tokenize(bad), SamplingParams()))
        assert e.value.field == field
    with pytest.raises(InvalidRequestError, match="priority"):
        engine.add_request(GenerateRequest("bad-priority", [1, 2], SamplingParams(), priority=-(2**40)))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
