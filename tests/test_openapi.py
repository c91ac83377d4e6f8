"""GET /openapi.json: a valid OpenAPI 3.1 document, public, built from the
table the parsers consult (request_schema.py); and the drift check: every
body field the app reads is in the document, and every field in it is read."""

from __future__ import annotations

import asyncio
import json
import logging

import jsonschema
import pytest
from serving import http_client, make_frontend

from shoal.proto.errors import InvalidRequestError
from shoal.router.fronts import openai_app, request_schema, strict_json
from shoal.router.fronts.openai_protocol import parse_chat, parse_completion, parse_detokenize, parse_tokenize
from shoal.router.fronts.request_schema import BODIES

USER = [{"role": "user", "content": "hi"}]
# Bodies that a parser reads to the end (valid, so no early refusal cuts the reading short).
BODY_SAMPLES = {
    "completions": [{"prompt": "hi", "max_tokens": 1}, {"prompt": "hi", "max_tokens": 1, "stream": True}],
    "chat": [{"messages": USER, "max_tokens": 1}, {"messages": USER, "max_tokens": 1, "stream": True}],
    "tokenize": [{"prompt": "hi"}, {"messages": USER}],
    "detokenize": [{"tokens": [1, 2]}],
    "load_lora_adapter": [{"lora_name": "a", "lora_path": "/nowhere"}],
    "unload_lora_adapter": [{"lora_name": "a"}],
}
PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "load_lora_adapter": "/v1/load_lora_adapter",
    "unload_lora_adapter": "/v1/unload_lora_adapter",
}


class Recording(dict):
    """A JSON object that notes every key the server looks up in it."""

    def __init__(self, data: dict, seen: set[str]):
        super().__init__(data)
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def test_the_document_is_valid_openapi_3_1_and_its_schemas_valid_json_schema():
    doc = openai_app.openapi_document()
    assert doc["openapi"].startswith("3.1")
    try:
        from openapi_spec_validator import validate
    except ImportError:  # the package is in the test extra; the schemas' own check below still runs
        validate = None
    if validate is not None:
        validate(doc)
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    # Every error status the app answers is documented, with the {"error": {...}} body.
    statuses = {s for s, _, _ in openai_app._ERRORS.values()}
    assert statuses >= {400, 401, 403, 404, 409, 413, 415, 429, 500, 503}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert statuses <= {int(s) for s in op["responses"]}, path
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "--api-key",
    }


def test_every_route_of_the_app_is_documented_and_the_document_is_public(tiny_model):
    async def main():
        fe = make_frontend(tiny_model, api_key="secret")
        async with http_client(fe) as c:
            doc = await c.get("/openapi.json")  # no key, as vLLM's
            refused = await c.get("/v1/models")
        return fe, doc, refused

    fe, doc, refused = asyncio.run(main())
    assert refused.status_code == 401
    assert doc.status_code == 200 and doc.json() == json.loads(json.dumps(openai_app.openapi_document()))
    assert doc.json()["paths"]["/openapi.json"]["get"]["security"] == []
    app = openai_app.OpenAIApp(fe, 1 << 20)
    routes = {r.path for r in app.starlette.routes}
    status_page = {"/api/status", "/api/auth", "/", "/static"}  # the operator's page, not the API
    assert routes - status_page == set(doc.json()["paths"])


def test_every_body_field_the_app_reads_is_documented_and_every_documented_one_read(tiny_model, monkeypatch):
    """Bodies go through the real app over a real engine with each lookup
    noted; a field a parser reads without the table, or one the table has
    and no parser reads, fails here."""
    seen: dict[str, set[str]] = {endpoint: set() for endpoint in BODIES}
    current = ["?"]
    loads = strict_json.loads

    def recording_loads(data: bytes):
        body = loads(data)
        record = seen[current[0]]
        if isinstance(body.get("stream_options"), dict):  # the one nested object the body's reader reads by name
            body["stream_options"] = Recording(body["stream_options"], seen.setdefault("stream_options", set()))
        return Recording(body, record)

    monkeypatch.setattr(strict_json, "loads", recording_loads)

    async def main():
        fe = make_frontend(tiny_model)
        answers = []
        async with http_client(fe) as c:
            for endpoint, bodies in BODY_SAMPLES.items():
                current[0] = endpoint
                for body in bodies:
                    if body.get("stream"):
                        body = dict(body, stream_options={"include_usage": True})
                    answers.append((endpoint, (await c.post(PATHS[endpoint], json=body)).status_code))
        return answers

    answers = asyncio.run(main())
    # Each went through its parser (the LoRA endpoints refuse only once the body is read: LoRA is off here).
    assert all(s == 200 for e, s in answers if "lora" not in e), answers
    doc = openai_app.openapi_document()["components"]["schemas"]
    for endpoint, fields in BODIES.items():
        documented = set(doc[f"{endpoint}_request"]["properties"])
        assert documented == {f.name for f in fields}
        assert seen[endpoint] == documented, (endpoint, seen[endpoint] ^ documented)
    stream_options = doc["completions_request"]["properties"]["stream_options"]["properties"]
    assert seen["stream_options"] == set(stream_options)


def _wrong_value(types: list[str]):
    """A JSON value of none of `types`."""
    for value, t in (("x", "string"), (7, "integer"), ([1], "array"), ({"a": 1}, "object"), (True, "boolean")):
        if t not in types and not (t == "integer" and "number" in types):
            return value
    raise AssertionError(types)


PARSERS = {
    "completions": parse_completion,
    "chat": parse_chat,
    "tokenize": parse_tokenize,
    "detokenize": parse_detokenize,
    "load_lora_adapter": lambda body: request_schema.check("load_lora_adapter", body),
    "unload_lora_adapter": lambda body: request_schema.check("unload_lora_adapter", body),
}


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_a_value_of_a_type_the_document_does_not_allow_is_a_400_naming_the_field(endpoint):
    base = BODY_SAMPLES[endpoint][0]
    for f in BODIES[endpoint]:
        types = f.schema["type"] if isinstance(f.schema["type"], list) else [f.schema["type"]]
        with pytest.raises(InvalidRequestError) as e:
            PARSERS[endpoint](dict(base, **{f.name: _wrong_value(types)}))
        assert e.value.field == f.name, (f.name, str(e.value))
        assert str(e.value).startswith(f"{f.name} must be "), str(e.value)


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger=request_schema.logger.name)
    for _ in range(3):
        parsed = parse_completion({"prompt": "hi", "not_a_field_of_this_api": 1})
    assert parsed.prompts[0].text == "hi"
    logged = [r for r in caplog.records if "not_a_field_of_this_api" in r.getMessage()]
    assert len(logged) == 1


def test_tokenize_checks_tools_beside_a_text_prompt_as_the_document_says():
    """Found by the HTTP fuzzer: tools beside a text prompt went unread, so a
    body the document refuses was answered 200."""
    with pytest.raises(InvalidRequestError) as e:
        parse_tokenize({"prompt": "hi", "tools": [{"function": "0"}]})
    assert e.value.field == "tools"
    tool = {"type": "function", "function": {"name": "f"}}
    assert parse_tokenize({"prompt": "hi", "tools": [tool]})[0].text == "hi"  # valid ones are still ignored
