"""Hostile structured-output specs and logit_bias: each is a 400 naming its
field over HTTP and INVALID_ARGUMENT over gRPC, the $ref check does work
linear in the spec (counted, never timed), a spec is checked once per
request and once per distinct spec, and logit_bias is bounded by
--max-logit-bias and checked once per request."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid

import grpc
import pytest
from serving import grpc_server, http_client, make_frontend

from shoal.proto import grammar as guidance
from shoal.proto import logit_bias as logit_bias_module
from shoal.proto import structured_params
from shoal.proto.errors import InvalidRequestError
from shoal.proto.json_pointer import PointerError, RefWalk, ref_cycle, resolve, schema_height
from shoal.proto.messages import GenerateRequest
from shoal.proto.structured_params import MAX_SCHEMA_HEIGHT, MAX_SPEC_CHARS
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc

UNICODE_ZEROS = "٠۰߀०০੦૦୦௦౦೦൦๐໐༠၀႐០᠐"
LIST_DOC = {"L": [{"type": "string"}, {"type": "integer"}], "a/b": 1, "a~b": 2, "": 3, "a b": 4}


@pytest.mark.parametrize(
    "ref, want",
    [
        ("#", LIST_DOC),
        ("#/L/0", {"type": "string"}),
        ("#/L/1", {"type": "integer"}),
        ("#/L/%31", {"type": "integer"}),  # percent-encoded, as a URI fragment is
        ("#/a~1b", 1),
        ("#/a~0b", 2),
        ("#/", 3),
        ("#/a%20b", 4),
        ("#/L/2", None),  # past the end: the library's to report
        ("#/L/-", None),
        ("#/L/99999999999999999999999", None),
        ("#/missing", None),
        ("#anchor", None),
    ],
)
def test_pointers_resolve_as_rfc_6901_says(ref, want):
    assert resolve(LIST_DOC, ref) == want


@pytest.mark.parametrize("token", [*UNICODE_ZEROS[1:], "²", "۱", "00", "01", "+1", " 1", "1 ", "0x1", "1e0"])
def test_array_indices_other_than_ascii_digits_are_refused(token):
    with pytest.raises(PointerError, match="ASCII digits"):
        resolve(LIST_DOC, "#/L/" + token)


def test_a_bad_escape_is_refused():
    with pytest.raises(PointerError, match="RFC 6901"):
        resolve(LIST_DOC, "#/a~2b")


def _unicode_zero_pointers(n: int) -> dict:
    """n properties naming one node through n spellings of its index in other scripts' zeros."""
    spellings = (z * width for width in range(1, 8) for z in UNICODE_ZEROS)
    props = {f"p{k}": {"$ref": "#/$defs/L/" + s} for k, s in zip(range(n), spellings)}
    return {"type": "object", "properties": props, "$defs": {"L": [{"type": "string"}]}}


def test_unicode_digit_pointers_are_a_clear_error_naming_the_field():
    schema = json.dumps(_unicode_zero_pointers(100))
    with pytest.raises(InvalidRequestError) as e:
        SO(json=schema, field="response_format").validate()
    assert e.value.field == "response_format" and "ASCII digits" in str(e.value)
    with pytest.raises(InvalidRequestError, match="ASCII digits") as e:
        SO(json={"properties": {"a": {"$ref": "#/$defs/L/²"}}, "$defs": {"L": [{}]}}).validate()
    assert e.value.field == "structured_outputs"


def _spellings(key: str):
    """Distinct percent-encodings of one key: each character plain or %XX."""
    for mask in itertools.product((False, True), repeat=len(key)):
        yield "".join(f"%{ord(c):02X}" if enc else c for c, enc in zip(key, mask))


def _cyclic_spec_near_the_cap() -> str:
    """a -> hub (k spellings) -> z (k spellings) -> a: each of a's k refs names
    hub, and hub's k refs name z, so an algorithm that walks pointers rather
    than nodes does k * k work (k ~ 2,400 here); the cycle closes at the end."""
    hub, z = "hubnodeabcdefgh", "zednodeabcdefgh"
    k = 2_400
    refs = lambda key: [{"$ref": f"#/$defs/{s}"} for s in itertools.islice(_spellings(key), k)]  # noqa: E731
    defs = {"a": {"anyOf": refs(hub)}, hub: {"anyOf": refs(z)}, z: {"anyOf": [{"$ref": "#/$defs/a"}]}}
    return json.dumps({"$ref": "#/$defs/a", "$defs": defs}, separators=(",", ":"))


def test_a_cyclic_spec_near_the_size_cap_is_checked_in_linear_work():
    text = _cyclic_spec_near_the_cap()
    assert MAX_SPEC_CHARS * 0.6 < len(text) <= MAX_SPEC_CHARS
    walk = RefWalk()
    cycle = ref_cycle(json.loads(text), walk)
    assert cycle is not None and cycle[0] == cycle[-1] and "#/$defs/a" in cycle
    # Each node expanded once, each edge followed once, each pointer token read
    # once per distinct $ref: a few times the number of objects (~25,000 here), far below k * k (5.8 million).
    assert walk.total <= len(text) // 4, walk
    with pytest.raises(InvalidRequestError, match=r"\$ref cycle"):
        SO(json=text).validate()


def test_an_acyclic_spec_with_many_spellings_is_accepted_in_linear_work():
    # The same shape without the closing edge: every node reached, no cycle.
    text = _cyclic_spec_near_the_cap().replace('{"anyOf":[{"$ref":"#/$defs/a"}]}', '{"type":"string"}')
    walk = RefWalk()
    assert ref_cycle(json.loads(text), walk) is None
    assert walk.total <= len(text) // 4, walk


def _chain(n: int, cyclic: bool, reverse: bool) -> dict:
    """n definitions each naming the next through a property; the last names the first (cyclic) or a string."""

    def last(k):
        return (
            {"$ref": f"#/$defs/d{k + 1}"} if k + 1 < n else ({"$ref": "#/$defs/d0"} if cyclic else {"type": "string"})
        )

    order = range(n - 1, -1, -1) if reverse else range(n)
    defs = {f"d{k}": {"type": "object", "properties": {"x": last(k)}} for k in order}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize("cyclic", [True, False], ids=["cyclic", "acyclic"])
@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "listed backwards"])
def test_a_long_chain_of_definitions_is_refused_in_linear_work_whatever_their_order(cyclic, reverse):
    # llguidance overflowed its thread's stack on a chain of ~900 (a crash of the whole process, router or worker).
    long = _chain(3000, cyclic, reverse)
    walk = RefWalk()
    assert schema_height(long, MAX_SCHEMA_HEIGHT, walk) > MAX_SCHEMA_HEIGHT
    assert walk.total < len(json.dumps(long)) / 4  # each object visited once
    with pytest.raises(InvalidRequestError, match="more than 256 deep") as e:
        SO(json=json.dumps(long)).validate()
    assert e.value.field == "structured_outputs"
    # A short chain, and a recursive tree (a node whose children are nodes), are served.
    assert schema_height(_chain(40, cyclic, reverse), MAX_SCHEMA_HEIGHT) <= MAX_SCHEMA_HEIGHT
    tree = {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
    }
    SO(json=json.dumps(tree)).validate()
    guidance.validate(SO(json=json.dumps(_chain(40, cyclic, reverse))))


def test_deep_nesting_is_refused_not_a_recursion_error():
    with pytest.raises(InvalidRequestError, match="nested too deeply") as e:
        SO(json="[" * 100_000, field="structured_outputs").validate()
    assert e.value.field == "structured_outputs"
    deep: dict = {}
    for _ in range(100_000):
        deep = {"not": deep}
    with pytest.raises(InvalidRequestError) as e:  # a dict too deep to serialize
        SO(json=deep, field="response_format")
    assert e.value.field == "response_format"


def _unique_schema() -> dict:
    # A title no other test uses: this spec's verdicts are computed here, not found in a cache.
    return {"type": "string", "maxLength": 4, "title": uuid.uuid4().hex}


def _count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)

    def counted(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_spec_is_checked_once_per_request_and_the_grammar_cache_hits_when_repeated(tiny_model, monkeypatch):
    """8 prompts x n=4 (32 engine requests) with one schema: its JSON check, the
    library's check and the worker's compile each run once; the same schema
    again runs none of them (the caches hit). logit_bias is checked once too."""
    schema_checks = _count_calls(monkeypatch, structured_params, "json_schema_problem")
    grammar_checks = _count_calls(monkeypatch, guidance, "problem")
    bias_checks = []
    real_init = logit_bias_module.LogitBias.__init__

    def counted_init(self, bias):
        bias_checks.append(len(bias))
        real_init(self, bias)

    monkeypatch.setattr(logit_bias_module.LogitBias, "__init__", counted_init)
    schema = _unique_schema()
    body = {
        "prompt": [f"prompt {i}" for i in range(8)],
        "n": 4,
        "max_tokens": 2,
        "temperature": 1.0,
        "seed": 3,
        "logit_bias": {str(t): 1.0 for t in range(300)},
        "structured_outputs": {"json": schema},
    }

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        manager = fe.pool.workers[0].engine.engine.structured_output
        async with http_client(fe) as c:
            first = await c.post("/v1/completions", json=body)
            counts = (len(schema_checks), len(grammar_checks), manager.num_compiled, len(bias_checks))
            hits = (guidance.GRAMMAR_CHECKS.num_hits, manager.num_cache_hits)
            second = await c.post("/v1/completions", json=body)
        after = (len(schema_checks), len(grammar_checks), manager.num_compiled)
        return first, second, counts, hits, after, (guidance.GRAMMAR_CHECKS.num_hits, manager.num_cache_hits)

    first, second, counts, hits, after, hits_after = asyncio.run(main())
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert len(first.json()["choices"]) == 32
    # once per request: one JSON check, one library check, one compile, one logit_bias check
    assert counts == (1, 1, 1, 1), counts
    # the same spec again: nothing recomputed, the caches hit
    assert after == counts[:3]
    assert hits_after[0] > hits[0] and hits_after[1] >= hits[1] + 32


def _hostile_bodies() -> list[tuple[dict, str, str]]:
    """(completions body, the field the 400 names, words in its message)."""
    sup = {"type": "object", "properties": {"a": {"$ref": "#/$defs/L/²"}}, "$defs": {"L": [{"type": "string"}]}}
    deep: dict = {"type": "object"}
    for _ in range(200):  # JSON text the schema check parses, nested past the grammar library's depth
        deep = {"type": "array", "items": deep}
    return [
        ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs", "nested too deeply"),
        ({"guided_json": "[" * 100_000}, "guided_json", "nested too deeply"),
        ({"structured_outputs": {"json": sup}}, "structured_outputs", "ASCII digits"),
        ({"structured_outputs": {"json": _unicode_zero_pointers(100)}}, "structured_outputs", "ASCII digits"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": sup}}},
            "response_format",
            "ASCII digits",
        ),
        ({"structured_outputs": {"json": json.dumps(deep)}}, "structured_outputs", "recursion"),
        ({"structured_outputs": {"json": _cyclic_spec_near_the_cap()}}, "structured_outputs", "$ref cycle"),
        ({"logit_bias": {str(t): 1.0 for t in range(301)}}, "logit_bias", "--max-logit-bias"),
    ]


def test_hostile_specs_and_logit_bias_are_400s_naming_the_field_over_http(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            out = []
            for extra, _, _ in _hostile_bodies():
                out.append(await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra}))
            ok = await c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2, "logit_bias": {str(t): -1.0 for t in range(300)}},
            )
        return out, ok, fe

    out, ok, fe = asyncio.run(main())
    for r, (_, field, words) in zip(out, _hostile_bodies()):
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], err
    assert ok.status_code == 200, ok.text  # 300 entries: the default limit, allowed
    assert fe.num_in_flight == 0


def test_hostile_specs_and_logit_bias_are_invalid_argument_naming_the_field_over_grpc(tiny_model):
    sup = {"type": "object", "properties": {"a": {"$ref": "#/$defs/L/²"}}, "$defs": {"L": [{"type": "string"}]}}
    cases = [
        (pb.SamplingParams(max_tokens=2, json_schema="[" * 100_000), "sampling.json_schema"),
        (pb.SamplingParams(max_tokens=2, json_schema=json.dumps(sup)), "sampling.json_schema"),
        (pb.SamplingParams(max_tokens=2, json_schema=json.dumps(_unicode_zero_pointers(50))), "sampling.json_schema"),
        (pb.SamplingParams(max_tokens=2, logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
    ]

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with grpc_server(fe) as addr, grpc.aio.insecure_channel(addr) as ch:
            stub = shoal_pb2_grpc.ShoalStub(ch)
            errs = []
            for sp, _ in cases:
                try:
                    await stub.Generate(pb.GenerateRequest(text="hi", sampling=sp)).read()
                    errs.append(None)
                except grpc.aio.AioRpcError as e:
                    errs.append(e)
            plain = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
            ok = [m async for m in stub.Generate(plain)]
        return errs, ok

    errs, ok = asyncio.run(main())
    for e, (_, field) in zip(errs, cases):
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e)
        assert field in e.details(), (field, e.details())
    assert ok[-1].finished.finish_reason in ("stop", "length")


def test_the_engine_refuses_a_logit_bias_past_its_limit(tiny_model):
    """The engine's own check (request_checks), for a request that reaches it some other way."""
    from shoal.workers import LLMEngine, SamplingParams

    engine = LLMEngine(model=tiny_model, num_kv_blocks=32, max_model_len=128, max_logit_bias=4)
    with pytest.raises(InvalidRequestError, match="--max-logit-bias") as e:
        engine.add_request(
            GenerateRequest("too-many", [1, 2, 3], SamplingParams(logit_bias={t: 1.0 for t in range(5)}))
        )
    assert e.value.field == "logit_bias" and "too-many" not in engine.requests
    engine.add_request(
        GenerateRequest("enough", [1, 2, 3], SamplingParams(max_tokens=1, logit_bias={t: 1.0 for t in range(4)}))
    )
    engine.shutdown()


def test_the_worker_compile_cache_is_bounded_by_count_and_size_and_remembers_refusals(tiny_model):
    from shoal.workers import LLMEngine

    engine = LLMEngine(model=tiny_model, num_kv_blocks=32, max_model_len=128)
    manager = engine.structured_output
    manager.cache_size, manager.cache_chars = 64, 40
    for i in range(6):
        manager.compiled(SO(regex=f"[ab]{{{i + 1}}}c{'x' * 10}"))  # ~18 characters each
    assert len(manager._cache) == 2 and manager._cached_chars <= 40  # by size: 2 fit, the rest went
    compiles = []
    real = manager.backend.compile
    manager.backend.compile = lambda params: compiles.append(params) or real(params)
    for field in ("guided_regex", "structured_outputs", "response_format"):
        with pytest.raises(InvalidRequestError) as e:
            manager.compiled(SO(regex="a(b", field=field))
        assert e.value.field == field and str(e.value).startswith(field + ": the regex")
    assert len(compiles) == 1  # the refusal was remembered (by digest), not compiled again
    engine.shutdown()
