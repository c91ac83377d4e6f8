"""The request fields that constrain a reply, as OpenAI and vLLM spell them:
`response_format`, vLLM's extra `structured_outputs` and its older `guided_*`
fields, each read into one StructuredOutputsParams that names its field."""

from __future__ import annotations

from typing import cast

from shoal.proto.errors import InvalidRequestError
from shoal.proto.structured_params import StructuredOutputsParams

GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
FIELDS = ("response_format", "structured_outputs", *(name for name, _ in GUIDED))
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's knobs for its own backends: accepted, and the grammar is shoal's either way.
IGNORED = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


def parse_structured(body: dict) -> StructuredOutputsParams | None:
    """The one constraint the request sets, None for none; two set is a 400
    naming the second (in FIELDS' order)."""
    found = [
        p
        for p in (
            response_format(body.get("response_format")),
            _structured_outputs(body.get("structured_outputs")),
            *(_guided(name, kind, body.get(name)) for name, kind in GUIDED),
        )
        if p is not None
    ]
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise InvalidRequestError(
            f"{second}: only one of {', '.join(FIELDS)} may be set; this request also sets {first}", field=second
        )
    return found[0] if found else None


def response_format(fmt) -> StructuredOutputsParams | None:
    """OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""
    f = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError(f"{f} must be an object with a string type", field=f)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field=f)
    if kind != "json_schema":
        raise InvalidRequestError(f"{f}.type must be text, json_object or json_schema, got {kind[:40]!r}", field=f)
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequestError(f'{f}.json_schema must be an object {{"name", "schema", "strict"}}', field=f)
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise InvalidRequestError(f"{f}.json_schema.name must be a non-empty string", field=f)
    for key, types, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
        if js.get(key) is not None and not isinstance(js[key], types):
            raise InvalidRequestError(f"{f}.json_schema.{key} must be {what}", field=f)
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{f}.json_schema.schema must be a JSON schema (an object)", field=f)
    # strict or not, the schema is enforced (as vLLM does)
    return StructuredOutputsParams(json=cast(str, schema), field=f)  # a dict: serialized as given


def _structured_outputs(so) -> StructuredOutputsParams | None:
    """vLLM's `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`."""
    f = "structured_outputs"
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidRequestError(f"{f} must be an object", field=f)
    if so.get("structural_tag") is not None:
        raise InvalidRequestError(f"{f}: structural_tag is not supported", field=f)
    unknown = sorted(k for k in so if k not in KINDS and k not in IGNORED and k != "structural_tag")
    if unknown:
        raise InvalidRequestError(f"{f}: unknown key {unknown[0][:40]!r}; known: {', '.join(KINDS + IGNORED)}", field=f)
    if so.get("json_object") is not None and not isinstance(so["json_object"], bool):
        raise InvalidRequestError(f"{f}: json_object must be a boolean", field=f)
    return StructuredOutputsParams(**{k: so[k] for k in KINDS if so.get(k) is not None}, field=f)


def _guided(name: str, kind: str, value) -> StructuredOutputsParams | None:
    """vLLM's older spellings, one field per kind."""
    return None if value is None else StructuredOutputsParams(**{kind: value}, field=name)
