"""The gRPC front in-process over real Workers, through the generated stubs:
streaming, status codes, cancellation and deadlines, health, reflection."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile

import grpc
import pytest
from engine_hold import EngineHold
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving import grpc_server, make_frontend

from shoal.proto import generate as proto_generate
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.workers import LLM, SamplingParams
from shoal.workers.worker import logger as worker_logger

PROMPT = "The quick brown fox"


def test_committed_stubs_match_the_proto():
    with tempfile.TemporaryDirectory() as tmp:
        for path in proto_generate.generate(tmp):
            rel = os.path.relpath(path, tmp)
            with open(path, "rb") as fresh, open(os.path.join(proto_generate.HERE, rel), "rb") as committed:
                assert fresh.read() == committed.read(), f"{rel} is stale: run `python proto/generate.py`"


def test_generate_streams_what_the_engine_makes_plus_info_load_tokenize(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=256)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]

    async def main():
        fe = make_frontend(tiny_model, num_workers=2)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            req = pb.GenerateRequest(
                text=PROMPT, sampling=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
            )
            msgs = [m async for m in stub.Generate(req)]
            by_ids = [
                m
                async for m in stub.Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=ref.prompt_token_ids),
                        sampling=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                    )
                )
            ]
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            load = await stub.GetLoad(pb.GetLoadRequest())
            tok = await stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
        return msgs, by_ids, info, load, tok

    msgs, by_ids, info, load, tok = asyncio.run(main())
    for stream in (msgs, by_ids):
        assert [t for m in stream for t in m.token_ids] == ref.token_ids
        assert "".join(m.text for m in stream) == ref.text
        assert all(not m.HasField("finished") for m in stream[:-1])
    fin = msgs[-1].finished
    assert fin.finish_reason == "length" and fin.worker.startswith("local-")
    assert fin.usage.prompt_tokens == len(ref.prompt_token_ids) and fin.usage.completion_tokens == 10
    assert 0 <= fin.timings.queue_s <= fin.timings.time_to_first_token_s <= fin.timings.total_s
    assert sum(len(m.logprobs) for m in msgs) == 10 and all(
        len(lp.top_logprobs) == 2 for m in msgs for lp in m.logprobs
    )
    assert (info.max_model_len, info.block_size, info.tensor_parallel_size, info.num_workers) == (
        llm.engine.max_model_len,
        16,
        1,
        2,
    )
    assert len(load.workers) == 2 and all(w.num_free_blocks == w.num_total_blocks == 256 for w in load.workers)
    assert list(tok.token_ids) == ref.prompt_token_ids and tok.count == len(ref.prompt_token_ids)


def test_request_id_is_the_servers_and_a_client_id_is_echoed_never_shared(tiny_model, caplog):
    sampling = pb.SamplingParams(max_tokens=8, ignore_eos=True)

    async def main():
        fe = make_frontend(tiny_model)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as a, grpc.aio.insecure_channel(addr) as b:
            mine = pb.GenerateRequest(request_id="my-id", text=PROMPT, sampling=sampling)
            return await asyncio.gather(
                _drain(shoal_pb2_grpc.ShoalStub(a).Generate(mine)),
                _drain(shoal_pb2_grpc.ShoalStub(b).Generate(mine)),
                _drain(shoal_pb2_grpc.ShoalStub(b).Generate(pb.GenerateRequest(text=PROMPT, sampling=sampling))),
            )

    with caplog.at_level(logging.INFO, logger=worker_logger.name):
        streams = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == worker_logger.name]
    assert all(s[-1].finished.finish_reason == "length" for s in streams)
    ids = []
    for stream, client_id in zip(streams, ("my-id", "my-id", "")):
        assert {m.client_request_id for m in stream} == {client_id}
        (rid,) = {m.request_id for m in stream}
        ids.append(rid)
        named = f"request {rid} (client id {client_id!r})" if client_id else f"request {rid}"
        assert sum(ln.startswith(f"{named} finished: length, ") for ln in lines) == 1, lines
    assert len(set(ids)) == 3 and "my-id" not in ids


@pytest.mark.parametrize(
    "request_kwargs,word",
    [
        ({}, "prompt"),
        ({"text": ""}, "empty"),
        ({"text": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
        ({"text": "hi", "sampling": pb.SamplingParams(max_tokens=10**6)}, "max_tokens"),
        ({"token_ids": pb.TokenIds(ids=[10**6])}, "vocabulary"),
        ({"text": "hi", "sampling": pb.SamplingParams(top_k=0)}, "top_k"),
        ({"text": "hi", "request_id": "x" * 300}, "request_id"),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_server_keeps_serving(tiny_model, request_kwargs, word):
    async def main():
        fe = make_frontend(tiny_model)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(pb.GenerateRequest(**request_kwargs))]
            ok = [m async for m in stub.Generate(pb.GenerateRequest(text=PROMPT))]
        return err.value, ok

    err, ok = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and word in err.details()
    assert ok[-1].finished.finish_reason in ("stop", "length")


def test_cancel_and_deadline_abort_in_the_engine_and_free_the_blocks(tiny_model):
    long = pb.SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        fe = make_frontend(tiny_model, max_num_batched_tokens=32)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=long))
            got = 0
            async for m in call:
                got += len(m.token_ids)
                if got >= 3:
                    # The engine steps no more (an add or an abort still goes in): the request is
                    # running at the load read, and the next one outlasts its deadline, on any machine.
                    hold = EngineHold(fe.pool.workers[0])
                    break
            busy = (await stub.GetLoad(pb.GetLoadRequest())).workers[0]
            call.cancel()
            freed_after = await _wait_free(stub)
            longer = pb.SamplingParams(max_tokens=1000, ignore_eos=True)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=longer), timeout=0.3)]
            deadline_freed_after = await _wait_free(stub)
            hold.release()
        return busy, freed_after, err.value, deadline_freed_after

    busy, freed_after, err, deadline_freed_after = asyncio.run(main())
    assert busy.num_free_blocks < busy.num_total_blocks and busy.num_running == 1
    assert freed_after < 1.0 and deadline_freed_after < 1.0
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def _wait_free(stub) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < 5:
        w = (await stub.GetLoad(pb.GetLoadRequest())).workers[0]
        if w.num_free_blocks == w.num_total_blocks and w.num_running == 0:
            return loop.time() - t0
        await asyncio.sleep(0.02)
    return float("inf")


def test_api_key_health_and_reflection(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, api_key="sekret")
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            codes = []
            for md in (None, (("authorization", "Bearer nope"),)):
                for call in (
                    lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md),
                    lambda: _drain(stub.Generate(pb.GenerateRequest(text=PROMPT), metadata=md)),
                ):
                    try:
                        await call()
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            good = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer sekret"),))
            health = health_pb2_grpc.HealthStub(ch)  # open without a key, for load balancers and probes
            serving = await health.Check(health_pb2.HealthCheckRequest(service="shoal.v1.Shoal"))
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            names = []
            async for r in refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=(("authorization", "Bearer sekret"),),
            ):
                names += [s.name for s in r.list_services_response.service]
            await fe.drain(1.0)
            with pytest.raises(grpc.aio.AioRpcError) as draining:
                await _drain(
                    stub.Generate(pb.GenerateRequest(text=PROMPT), metadata=(("authorization", "Bearer sekret"),))
                )
        return codes, good, serving, names, draining.value

    codes, good, serving, names, draining = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert good.model == "tiny-llama0"
    assert serving.status == health_pb2.HealthCheckResponse.SERVING
    assert "shoal.v1.Shoal" in names and "grpc.health.v1.Health" in names
    assert draining.code() == grpc.StatusCode.UNAVAILABLE


async def _drain(call):
    return [m async for m in call]


def test_flood_past_max_waiting_gets_resource_exhausted_and_admitted_ones_finish(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(10)]
    ref = {p: o.token_ids for p, o in zip(prompts, LLM(tiny_model, num_kv_blocks=256).generate(prompts, params))}

    async def main():
        fe = make_frontend(tiny_model, max_waiting=1, max_num_seqs=2)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)

            async def one(p):
                try:
                    req = pb.GenerateRequest(
                        text=p, sampling=pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
                    )
                    return [t async for m in stub.Generate(req) for t in m.token_ids]
                except grpc.aio.AioRpcError as e:
                    return e.code()

            return await asyncio.gather(*(one(p) for p in prompts))

    out = asyncio.run(main())
    refused = [o for o in out if not isinstance(o, list)]
    assert refused and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    served = [(p, o) for p, o in zip(prompts, out) if isinstance(o, list)]
    assert served and all(o == ref[p] for p, o in served)
