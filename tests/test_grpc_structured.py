"""The gRPC front's structured output, logit_bias and n, through the
generated stubs over real Workers: each reply equals the engine's own run
of the same params, and bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import grpc
import jsonschema
import pytest
from engine_hold import EngineHold
from serving import grpc_server, make_frontend

from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc
from shoal.workers import LLM, SamplingParams
from shoal.workers.worker import logger as worker_logger

PROMPT = "The quick brown fox"
# Every string bounded: a random model would never close an open one.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_threads=1, num_kv_blocks=256) as llm:
        yield llm


async def drain(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]


def serve(model: str, requests: list, **engine) -> list:
    """Each request's messages (a Tokenize request's reply), or its
    AioRpcError, from one server; then one plain request's messages."""

    async def main():
        fe = make_frontend(model, num_threads=1, **engine)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            out = []
            for req in requests:
                try:
                    if isinstance(req, pb.TokenizeRequest):
                        out.append(await stub.Tokenize(req))
                    else:
                        out.append(await drain(stub.Generate(req)))
                except grpc.aio.AioRpcError as e:
                    out.append(e)
            out.append(await drain(stub.Generate(pb.GenerateRequest(text=PROMPT))))
        return out

    return asyncio.run(main())


def text_of(msgs) -> str:
    return "".join(m.text for m in msgs)


def test_json_regex_and_choice_replies_match_and_equal_the_engines(tiny_model, llm):
    kinds = [
        (dict(json_schema=json.dumps(PERSON)), SO(json=PERSON)),
        (dict(json_object=True), SO(json_object=True)),
        (dict(regex=REGEX), SO(regex=REGEX)),
        (dict(choice=pb.ChoiceList(choices=CHOICES)), SO(choice=CHOICES)),
    ]
    seeds = (1, 2)
    reqs = [
        pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=64, temperature=1.0, seed=s, **kw))
        for kw, _ in kinds
        for s in seeds
    ]
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured_outputs=so) for _, so in kinds for s in seeds
    ]
    refs = llm.generate([PROMPT] * len(params), params)
    *got, plain = serve(tiny_model, reqs)
    assert plain[-1].finished.finish_reason in ("stop", "length")
    for msgs, ref, p in zip(got, refs, params):
        assert [t for m in msgs for t in m.token_ids] == ref.token_ids
        text, so = text_of(msgs), p.structured_outputs
        assert text == ref.text and msgs[-1].finished.finish_reason == ref.finish_reason
        if so.json_object:  # its strings are unbounded: a random model may still be in one at max_tokens
            assert text.startswith("{") and (ref.finish_reason == "length" or isinstance(json.loads(text), dict))
            continue
        assert ref.finish_reason == "stop", text
        if so.json is not None:
            jsonschema.validate(json.loads(text), PERSON)
        elif so.regex is not None:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
    # Unconstrained, the same seeds give no JSON: the mask did the work.
    free = llm.generate([PROMPT] * 2, [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in seeds])
    assert not any(o.text.startswith("{") for o in free)


BAD_SAMPLING = [
    (pb.SamplingParams(regex="a(b"), "sampling.regex"),
    (
        pb.SamplingParams(
            json_schema=json.dumps(
                {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
            )
        ),
        "sampling.json_schema",
    ),
    (pb.SamplingParams(json_schema="{not json"), "sampling.json_schema"),
    (pb.SamplingParams(choice=pb.ChoiceList()), "sampling.choice"),
    (pb.SamplingParams(grammar="start: (foo"), "sampling.grammar"),
    (pb.SamplingParams(logit_bias={5: 200.0}), "logit_bias"),
    (pb.SamplingParams(logit_bias={5: float("nan")}), "logit_bias"),
    (pb.SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
    (pb.SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (pb.SamplingParams(n=0), "n"),
    (pb.SamplingParams(n=5), "n"),  # above --max-n 4
]
BAD = [(pb.GenerateRequest(text=PROMPT, sampling=sp), field) for sp, field in BAD_SAMPLING]


def test_bad_values_are_invalid_argument_naming_the_field_and_the_server_keeps_serving(tiny_model):
    assert_invalid(tiny_model, BAD, max_n=4)


def assert_invalid(model: str, bad: list[tuple[pb.GenerateRequest, str]], **engine) -> None:
    """Each request is INVALID_ARGUMENT naming its field, and the server serves on."""
    *errs, ok = serve(model, [req for req, _ in bad], **engine)
    for err, (req, field) in zip(errs, bad):
        assert isinstance(err, grpc.aio.AioRpcError), (req, err)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, err)
        assert re.search(rf"(^|\W){re.escape(field)}\W", err.details()), (field, err.details())
    assert ok[-1].finished.finish_reason in ("stop", "length")


def test_n_streams_each_choice_with_its_index_and_seed_plus_k(tiny_model, llm, caplog):
    sampling = pb.SamplingParams(max_tokens=12, temperature=1.0, seed=100, n=3, ignore_eos=True, logprobs=1)
    refs = llm.generate(
        [PROMPT] * 3, [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + k, ignore_eos=True) for k in range(3)]
    )
    with caplog.at_level(logging.INFO, logger=worker_logger.name):
        msgs, greedy, _ = serve(
            tiny_model,
            [
                pb.GenerateRequest(request_id="mine", text=PROMPT, sampling=sampling),
                pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=6, temperature=0, n=2)),
            ],
        )
    (rid,) = {m.request_id for m in msgs}
    assert {m.client_request_id for m in msgs} == {"mine"}
    assert sorted({m.index for m in msgs}) == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records if r.name == worker_logger.name]
    for k, ref in enumerate(refs):
        choice = [m for m in msgs if m.index == k]
        assert [t for m in choice for t in m.token_ids] == ref.token_ids
        assert text_of(choice) == ref.text and sum(len(m.logprobs) for m in choice) == 12
        assert [m.HasField("finished") for m in choice] == [False] * (len(choice) - 1) + [True]
        fin = choice[-1].finished
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 12
        assert sum(ln.startswith(f"request {rid}-{k} (client id 'mine') finished: length") for ln in lines) == 1
    assert len({tuple(r.token_ids) for r in refs}) == 3  # seed + k: the choices differ
    assert sorted({m.index for m in greedy}) == [0, 1]
    assert text_of(m for m in greedy if m.index == 0) == text_of(m for m in greedy if m.index == 1)


def test_n_with_a_grammar_gives_every_choice_a_valid_reply(tiny_model):
    sampling = pb.SamplingParams(max_tokens=64, temperature=1.0, n=4, json_schema=json.dumps(PERSON))
    msgs, _ = serve(tiny_model, [pb.GenerateRequest(text=PROMPT, sampling=sampling)])
    for k in range(4):
        choice = [m for m in msgs if m.index == k]
        assert choice[-1].finished.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(choice)), PERSON)


def test_logit_bias_forces_a_token_under_greedy(tiny_model, llm):
    ref = llm.generate([PROMPT], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])[0]
    forced = next(t for t in range(300, 512) if t not in ref.token_ids)
    banned = ref.token_ids[0]
    msgs, down, _ = serve(
        tiny_model,
        [
            pb.GenerateRequest(
                text=PROMPT,
                sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={forced: 100.0}),
            ),
            pb.GenerateRequest(
                text=PROMPT,
                sampling=pb.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logit_bias={banned: -100.0}),
            ),
        ],
    )
    assert [t for m in msgs for t in m.token_ids] == [forced] * 8
    assert [t for m in down for t in m.token_ids] != [banned]


def test_cancelling_an_n_request_aborts_every_choice_and_frees_the_blocks(tiny_model):
    long = pb.SamplingParams(max_tokens=200, ignore_eos=True, n=3)

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=long))
            seen: set[int] = set()
            async for m in call:
                seen.add(m.index)
                if len(seen) == 3:
                    # The engine steps no more: all three are running at the load read.
                    hold = EngineHold(fe.pool.workers[0])
                    break
            busy = (await stub.GetLoad(pb.GetLoadRequest())).workers[0]
            call.cancel()
            freed = await _all_free(stub)
            hold.release()
        return busy, freed

    busy, freed = asyncio.run(main())
    assert busy.num_running == 3 and busy.num_free_blocks < busy.num_total_blocks
    assert freed


async def _all_free(stub) -> bool:
    """Whether the worker gets back to no request and every block free (the abort is asynchronous)."""
    for _ in range(600):
        w = (await stub.GetLoad(pb.GetLoadRequest())).workers[0]
        if w.num_free_blocks == w.num_total_blocks and w.num_running == 0 and w.num_waiting == 0:
            return True
        await asyncio.sleep(0.05)
    return False
