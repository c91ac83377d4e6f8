"""Admission by what a request costs (router/fronts/admission.py): a request
is prompts x max(n, best_of) sequences against --max-concurrent-requests,
held until its streams end however they end, and its prompt tokens plus
max_tokens for every sequence must fit --max-tokens-per-request. The engine
is held with a hook (engine_hold.py) so admitted requests stay in flight."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from engine_hold import EngineHold, until
from serving import free_port, grpc_server, make_frontend

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.ingress import start_http
from shoal.router.fronts.openai_app import OpenAIApp

LIMIT = 100
ONE = {"prompt": "The quick brown fox", "max_tokens": 2, "ignore_eos": True}


def _client(fe) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=OpenAIApp(fe, 1 << 20).app), base_url="http://shoal")


def test_http_counts_sequences_not_requests(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, max_waiting=512)
        fe.admission.max_sequences = LIMIT
        hold = EngineHold(fe.pool.workers[0])
        async with _client(fe) as c:
            huge = await c.post("/v1/completions", json={"prompt": ["Hi"] * 64, "n": 16, "max_tokens": 1})
            # 6 prompts x n 15 = 90 sequences, held in the engine
            big = asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": [f"p{i}" for i in range(6)], "n": 15, "max_tokens": 2})
            )
            in_engine = await until(lambda: len(hold.eng.requests) == 90)
            held = fe.admission.in_flight
            refused = await c.post("/v1/completions", json=dict(ONE, n=16))  # 90 + 16 > 100
            one = asyncio.ensure_future(c.post("/v1/completions", json=ONE))  # 90 + 1 fits
            one_in = await until(lambda: len(hold.eng.requests) == 91)
            hold.release()
            done = await asyncio.gather(big, one)
            return huge, in_engine, held, refused, one_in, done, fe.admission.in_flight

    huge, in_engine, held, refused, one_in, done, left = asyncio.run(main())
    assert huge.status_code == 400
    err = huge.json()["error"]
    assert err["param"] == "n" and "1024 sequences" in err["message"] and "--max-concurrent-requests" in err["message"]
    assert in_engine < 10 and held == 90
    assert refused.status_code == 429
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and "--max-concurrent-requests" in err["message"]
    assert one_in < 10 and [r.status_code for r in done] == [200, 200]
    assert len(done[0].json()["choices"]) == 90 and left == 0


def test_sequences_come_back_after_errors(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, max_waiting=2)
        fe.admission.max_sequences = LIMIT
        async with _client(fe) as c:
            bad = await c.post("/v1/completions", json={"prompt": [[1, 2], [10**6]], "n": 3})  # refused in prepare
            after_bad = fe.admission.in_flight
            # 4 sequences on a worker that queues 2: the worker refuses the last ones
            hold = EngineHold(fe.pool.workers[0])
            full = asyncio.ensure_future(c.post("/v1/completions", json=dict(ONE, n=4)))
            await until(lambda: len(hold.eng.requests) == 2)
            hold.release()
            full = await full
            return bad, after_bad, full, fe.admission.in_flight

    bad, after_bad, full, left = asyncio.run(main())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt" and after_bad == 0
    assert full.status_code == 429 and left == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_sequences_come_back_when_the_client_hangs_up(tiny_model, stream):
    async def main():
        fe = make_frontend(tiny_model)
        fe.admission.max_sequences = LIMIT
        port = free_port()
        server, task = await start_http(OpenAIApp(fe, 1 << 20).app, "127.0.0.1", port)
        try:
            hold = EngineHold(fe.pool.workers[0], steps=2)
            body = json.dumps({"prompt": ["ab", "cd"], "n": 3, "max_tokens": 150, "ignore_eos": True, "stream": stream})
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
            )
            await writer.drain()
            held_after = await until(lambda: hold.held(2))
            held = fe.admission.in_flight
            if stream:  # the client has a token before it hangs up
                seen = b""
                while b"data: {" not in seen:
                    seen += await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            back = await until(lambda: fe.admission.in_flight == 0)
            hold.release()
            return held_after, held, back
        finally:
            server.should_exit = True
            await task

    held_after, held, back = asyncio.run(main())
    assert held_after < 10 and held == 6
    assert back < 10, "the hung-up request kept its sequences"


def test_chat_default_max_tokens_shrinks_to_fit_and_a_chosen_one_must(tiny_model):
    budget = 200
    chat = {"messages": [{"role": "user", "content": "Say something"}], "n": 16, "ignore_eos": True}

    async def main():
        fe = make_frontend(tiny_model)
        fe.admission.max_tokens_per_request = budget
        async with _client(fe) as c:
            shrunk = await c.post("/v1/chat/completions", json=chat)
            chosen = await c.post("/v1/chat/completions", json=dict(chat, max_tokens=100))
            fits = await c.post("/v1/chat/completions", json=dict(chat, max_tokens=2))
            long = await c.post(
                "/v1/chat/completions", json=dict(chat, messages=[{"role": "user", "content": "x " * 300}])
            )
        return shrunk, chosen, fits, long, fe.admission.in_flight

    shrunk, chosen, fits, long, left = asyncio.run(main())
    assert shrunk.status_code == 200, shrunk.text
    body = shrunk.json()
    prompt = body["usage"]["prompt_tokens"]
    each = (budget - prompt) // 16
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 16 * each and prompt + 16 * each <= budget
    assert chosen.status_code == 400
    err = chosen.json()["error"]
    assert err["param"] == "max_tokens" and "--max-tokens-per-request" in err["message"]
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 32
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert left == 0


def test_grpc_counts_sequences_and_reserves_tokens(tiny_model):
    def req(n, **sampling):
        return pb.GenerateRequest(
            text="The quick brown fox", sampling=pb.SamplingParams(n=n, ignore_eos=True, **sampling)
        )

    async def main():
        fe = make_frontend(tiny_model, max_waiting=64)
        fe.admission.max_sequences = 20
        fe.admission.max_tokens_per_request = 300
        hold = EngineHold(fe.pool.workers[0])
        async with grpc_server(fe) as address, grpc.aio.insecure_channel(address) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            held = asyncio.ensure_future(_tokens(stub.Generate(req(16, max_tokens=2))))
            await until(lambda: len(hold.eng.requests) == 16)
            outcomes = {}
            for name, r in {
                "full": req(8, max_tokens=2),  # 16 + 8 > 20
                "too_many_tokens": req(2, max_tokens=200),  # the prompt + 2 x 200 > 300
            }.items():
                try:
                    outcomes[name] = await _tokens(stub.Generate(r))
                except grpc.aio.AioRpcError as e:
                    outcomes[name] = (e.code(), e.details())
            one = asyncio.ensure_future(_tokens(stub.Generate(req(1, max_tokens=2))))
            await until(lambda: len(hold.eng.requests) == 17)
            hold.release()
            done = await asyncio.gather(held, one)
            fe.admission.max_sequences = 10
            try:
                await _tokens(stub.Generate(req(16, max_tokens=2)))
            except grpc.aio.AioRpcError as e:
                outcomes["never"] = (e.code(), e.details())
        return outcomes, done, fe.admission.in_flight

    outcomes, done, left = asyncio.run(main())
    code, details = outcomes["full"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-requests" in details
    code, details = outcomes["too_many_tokens"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-tokens-per-request" in details
    code, details = outcomes["never"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "16 sequences" in details
    assert [len(t) for t in done] == [32, 2] and left == 0


async def _tokens(call) -> list[int]:
    return [t async for m in call for t in m.token_ids]
