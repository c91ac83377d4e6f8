"""Admission at the fronts: past --max-concurrent-requests a router answers
429 (HTTP) or RESOURCE_EXHAUSTED (gRPC) at once, and the requests it took
finish; gRPC's priority is the operator's unless --allow-client-priority.
The engine is held (engine_hold.py) so the admitted requests stay in flight."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from engine_hold import EngineHold, until
from serving import make_frontend

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.router.fronts.openai_app import OpenAIApp

LIMIT = 2
BODY = {"prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True}


def test_http_past_max_concurrent_requests_gets_429_and_the_admitted_finish(tiny_model):
    async def main():
        fe = make_frontend(tiny_model)
        hold = EngineHold(fe.pool.workers[0])
        oa = OpenAIApp(fe, 1 << 20, max_concurrent_requests=LIMIT)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=oa.app), base_url="http://shoal") as c:
            admitted = [
                asyncio.ensure_future(c.post("/v1/completions", json=dict(BODY, stream=s))) for s in (False, True)
            ]
            in_engine = await until(lambda: len(hold.eng.requests) == LIMIT)
            refused = await c.post("/v1/completions", json=BODY)
            health = await c.get("/health")  # not counted: probes still get through
            hold.release()
            done = await asyncio.gather(*admitted)
            after = await c.post("/v1/completions", json=BODY)
        return in_engine, refused, health, done, after, oa.admission.in_flight

    in_engine, refused, health, done, after, in_flight = asyncio.run(main())
    assert in_engine < 10
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
    assert health.status_code == 200
    assert [r.status_code for r in done] == [200, 200]
    assert done[0].json()["usage"]["completion_tokens"] == 3 and done[1].text.endswith("data: [DONE]\n\n")
    assert after.status_code == 200 and in_flight == 0


async def _served(fe, **kw):
    server = GrpcServer(fe, "127.0.0.1", 0, 1 << 20, **kw)
    await server.start()
    return server


def test_grpc_past_max_concurrent_rpcs_gets_resource_exhausted_and_the_admitted_finish(tiny_model):
    req = pb.GenerateRequest(text="The quick brown fox", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))

    async def main():
        fe = make_frontend(tiny_model)
        hold = EngineHold(fe.pool.workers[0])
        server = await _served(fe, max_concurrent_rpcs=LIMIT)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                admitted = [asyncio.ensure_future(_tokens(stub.Generate(req))) for _ in range(LIMIT)]
                in_engine = await until(lambda: len(hold.eng.requests) == LIMIT)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _tokens(stub.Generate(req))
                hold.release()
                done = await asyncio.gather(*admitted)
                after = await _tokens(stub.Generate(req))
        finally:
            await server.stop(0)
        return in_engine, refused.value, done, after

    in_engine, refused, done, after = asyncio.run(main())
    assert in_engine < 10
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [len(t) for t in done] == [3, 3] and len(after) == 3


async def _tokens(call) -> list[int]:
    return [t async for m in call for t in m.token_ids]


@pytest.mark.parametrize("allowed", [False, True])
def test_grpc_priority_is_the_operators_unless_allowed(tiny_model, allowed):
    def req(priority):
        return pb.GenerateRequest(
            text="The quick brown fox", priority=priority, sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
        )

    async def main():
        fe = make_frontend(tiny_model)
        server = await _served(fe, allow_client_priority=allowed)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = shoal_pb2_grpc.ShoalStub(ch)
                outcomes = {}
                for p in (-(2**31), 7):
                    hold = EngineHold(fe.pool.workers[0])  # it stays queued while the test looks
                    call = asyncio.ensure_future(_tokens(stub.Generate(req(p))))
                    await until(lambda: call.done() or bool(hold.eng.requests))
                    queued = [prio for prio, _, _ in list(hold.eng.scheduler.waiting)]
                    hold.release()
                    try:
                        outcomes[p] = (queued, len(await call))
                    except grpc.aio.AioRpcError as e:
                        outcomes[p] = (e.code(), e.details())
                zero = await _tokens(stub.Generate(req(0)))  # the default is always fine
        finally:
            await server.stop(0)
        return outcomes, zero

    outcomes, zero = asyncio.run(main())
    assert len(zero) == 3
    for p, out in outcomes.items():
        if allowed:
            assert out == ([p], 3)  # the scheduler queued it under the client's priority
        else:
            assert out[0] == grpc.StatusCode.INVALID_ARGUMENT and "priority" in out[1]
