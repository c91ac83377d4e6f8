"""A client that hangs up stops its work, streaming or not, before or after
its first token (vLLM's with_cancellation): over a real uvicorn server and
gRPC, the request leaves the worker within 1 s and its KV blocks are free.
The engine is held with a hook (engine_hold.py: it steps no further until
something is submitted to it, the abort), so the machine's speed plays no part."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from engine_hold import EngineHold, until
from serving import free_port, grpc_server, make_frontend

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.router.fronts.ingress import start_http
from shoal.router.fronts.openai_app import OpenAIApp

# A prompt several prefill chunks long: one step computes 16 of its tokens and yields none.
LONG_PROMPT = list(range(5, 69))
SHORT_PROMPT = list(range(5, 13))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("first_token", [False, True], ids=["before-first-token", "after-first-token"])
@pytest.mark.parametrize("num_prompts", [1, 2])
def test_http_client_hanging_up_aborts_in_the_engine_and_frees_its_blocks(tiny_model, stream, first_token, num_prompts):
    prompt = SHORT_PROMPT if first_token else LONG_PROMPT
    steps = 3 if first_token else 1

    async def main():
        fe = make_frontend(tiny_model, max_num_batched_tokens=16 * num_prompts)
        worker = fe.pool.workers[0]
        port = free_port()
        server, task = await start_http(OpenAIApp(fe, 1 << 20).app, "127.0.0.1", port)
        try:
            hold = EngineHold(worker, steps)
            body = json.dumps(
                {
                    "prompt": prompt if num_prompts == 1 else [prompt] * num_prompts,
                    "max_tokens": 400,  # 2 prompts of 64 tokens + 2 x 400 fit --max-tokens-per-request (1024)
                    "ignore_eos": True,
                    "stream": stream,
                }
            ).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            held_after = await until(lambda: hold.held(steps))
            eng = worker.engine.engine
            ids = list(eng.requests)
            tokens = sum(r.seq.num_output_tokens for r in eng.requests.values())
            busy = worker.engine.stats()
            seen = b""
            if stream and first_token:  # the client has read a token before it hangs up
                while b"data: {" not in seen:
                    seen += await asyncio.wait_for(reader.read(4096), 10)
            writer.close()
            gone_after = await until(lambda: hold.gone(ids))
            return held_after, ids, tokens, busy, seen, gone_after, fe.num_in_flight
        finally:
            server.should_exit = True
            await task

    held_after, ids, tokens, busy, seen, gone_after, in_flight = asyncio.run(main())
    assert held_after < 10 and len(ids) == num_prompts
    assert busy.num_free_blocks < busy.num_total_blocks  # it held blocks when the client went
    assert (tokens > 0) == first_token
    assert gone_after < 1.0, "the request outlived its client"
    assert in_flight == 0


def test_grpc_cancel_before_the_first_token_aborts_in_the_engine(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, max_num_batched_tokens=16)
        worker = fe.pool.workers[0]
        hold = EngineHold(worker, 1)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            call = stub.Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=LONG_PROMPT), sampling=pb.SamplingParams(max_tokens=500, ignore_eos=True)
                )
            )
            reading = asyncio.ensure_future(call.read())
            held_after = await until(lambda: hold.held(1))
            ids = list(worker.engine.engine.requests)
            busy = worker.engine.stats()
            call.cancel()
            gone_after = await until(lambda: hold.gone(ids))
            await asyncio.gather(reading, return_exceptions=True)
        return held_after, ids, busy, gone_after, fe.num_in_flight

    held_after, ids, busy, gone_after, in_flight = asyncio.run(main())
    assert held_after < 10 and len(ids) == 1
    assert busy.num_free_blocks < busy.num_total_blocks
    assert gone_after < 1.0 and in_flight == 0
