"""The HTTP API's request bodies as data: each endpoint's top-level fields,
each with its JSON Schema (2020-12) and a line for the reader. The OpenAPI
document (openapi.py) is built from this table, and the parsers
(openai_protocol.py, the LoRA endpoints) consult it for every field's JSON
type and for fields they do not know; tests/test_openapi.py checks that every
field a parser reads is here and every field here is read, so the document
cannot drift from the code. Nested shapes (messages, tools...) are checked by
the hand-written readers; here they are documented."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shoal.proto.block_hash import MAX_CACHE_SALT_CHARS
from shoal.proto.errors import InvalidRequestError

logger = logging.getLogger(__name__)
MAX_USER_LEN = 256  # `user` is logged, so it is bounded like a client's request id


@dataclass(slots=True, frozen=True)
class Field:
    """One top-level body field. `schema["type"]` is always set: the type
    check reads it. JSON null is "not set" for every field (the default)."""

    name: str
    schema: dict
    description: str
    required: bool = False
    expect: str | None = None  # what the type error says it must be, when the types alone say too little


def _int(**kw) -> dict:
    return {"type": "integer", **kw}


def _num(**kw) -> dict:
    return {"type": "number", **kw}


BOOL, STRING = {"type": "boolean"}, {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": _int(minimum=0)}
_SPEC = {"type": "string", "minLength": 1}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": STRING},
}
_HISTORY_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": ["string", "null"]},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": STRING, "arguments": {"type": ["string", "object", "null"]}},
        },
    },
}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": STRING,
        "content": {"type": ["string", "array", "null"], "items": _TEXT_PART},
        "name": {"description": "the author's name, as the chat template gets it (a string; else ignored)"},
        "tool_calls": {"description": "an assistant's calls (read for role assistant only)"},
        "tool_call_id": {"description": "the call a role tool message answers"},
    },
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
            "then": {"properties": {"tool_calls": {"type": ["array", "null"], "items": _HISTORY_CALL}}},
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": STRING}},
        },
    ],
}
TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": ["string", "null"]},
                "parameters": {"type": ["object", "null"], "properties": {"type": {"const": "object"}}},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
}
_TOOL_CHOICE = {
    "type": ["string", "object"],
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["function"],
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _SPEC}},
            },
        },
    ],
}
_RESPONSE_FORMAT = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"description": "read only under type json_schema (ignored otherwise)"},
    },
    "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
    "then": {
        "required": ["json_schema"],
        "properties": {
            "json_schema": {
                "type": "object",
                "required": ["name", "schema"],
                "properties": {
                    "name": _SPEC,
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                    "description": {"type": ["string", "null"]},
                },
            }
        },
    },
}
_IGNORED_KNOBS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")
_STRUCTURED_OUTPUTS = {
    "type": "object",
    "properties": {
        "json": {"type": ["string", "object"]},
        "regex": _SPEC,
        "choice": {"type": "array", "minItems": 1, "items": _SPEC},
        "grammar": _SPEC,
        "json_object": BOOL,
        **{k: {"description": "accepted for vLLM's clients; no effect"} for k in _IGNORED_KNOBS},
    },
    "additionalProperties": False,
    "oneOf": [{"required": [kind]} for kind in ("json", "regex", "choice", "grammar", "json_object")],
}

# Sampling and constraints: the same on both completion endpoints (SamplingParams' own bounds).
SAMPLING = (
    Field("temperature", _num(minimum=0), "0 is greedy"),
    Field("top_p", _num(exclusiveMinimum=0, maximum=1), "nucleus sampling; 1 disables it"),
    Field("min_p", _num(minimum=0, maximum=1), "0 disables it"),
    Field("top_k", {**_int(minimum=-1), "not": {"const": 0}}, "-1 disables it"),
    Field("seed", _int(minimum=-(2**63), maximum=2**64 - 1), "the same tokens whatever else shares the batch"),
    Field("presence_penalty", _num(minimum=-2, maximum=2), ""),
    Field("frequency_penalty", _num(minimum=-2, maximum=2), ""),
    Field("repetition_penalty", _num(exclusiveMinimum=0, maximum=100), "1 disables it"),
    Field("min_tokens", _int(minimum=0), "at most max_tokens"),
    Field("ignore_eos", BOOL, ""),
    Field("skip_special_tokens", BOOL, "default true"),
    Field(
        "stop",
        {"type": ["string", "array"], "minLength": 1, "items": _SPEC},
        "stop strings",
        expect="a string or an array of strings",
    ),
    Field("stop_token_ids", _TOKEN_IDS, ""),
    Field(
        "logit_bias",
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,12}$"},
            "additionalProperties": _num(minimum=-100, maximum=100),
        },
        "token id (a decimal string) -> a number added to its logit; at most --max-logit-bias entries",
    ),
    Field("response_format", _RESPONSE_FORMAT, "OpenAI's: text, json_object or json_schema"),
    Field("structured_outputs", _STRUCTURED_OUTPUTS, "vLLM's: exactly one of json, regex, choice, grammar"),
    Field("guided_json", {"type": ["string", "object"]}, "vLLM's older spelling of structured_outputs.json"),
    Field("guided_regex", _SPEC, "vLLM's older spelling of structured_outputs.regex"),
    Field("guided_choice", {"type": "array", "minItems": 1, "items": _SPEC}, "vLLM's older structured_outputs.choice"),
    Field("guided_grammar", _SPEC, "vLLM's older spelling of structured_outputs.grammar"),
    Field(
        "cache_salt",
        {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS},
        "vLLM's: only requests with the same salt share prefix-cache blocks",
    ),
)
# What both completion endpoints read besides sampling.
COMMON = (
    Field("model", STRING, "the served model, or a LoRA adapter's name (GET /v1/models)"),
    Field("stream", BOOL, "server-sent events, ending with data: [DONE]"),
    Field(
        "stream_options",
        {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL}},
        "only with stream=true",
    ),
    Field("user", {"type": "string", "maxLength": MAX_USER_LEN}, "logged with the request id"),
    Field("n", _int(minimum=1), "choices per prompt; at most --max-n"),
)
_MAX_TOKENS = _int(minimum=1)

BODIES: dict[str, tuple[Field, ...]] = {
    "completions": (
        Field(
            "prompt",
            {
                "type": ["string", "array"],
                "anyOf": [
                    _SPEC,
                    {**_TOKEN_IDS, "minItems": 1},
                    {"type": "array", "minItems": 1, "items": {"anyOf": [_SPEC, {**_TOKEN_IDS, "minItems": 1}]}},
                ],
            },
            "text, token ids, or an array of at most --max-prompts of either",
            required=True,
            expect="a string, an array of token ids, or a non-empty array of those",
        ),
        Field("suffix", {"type": "string", "maxLength": 0}, "not supported: empty or null only"),
        Field("max_tokens", _MAX_TOKENS, "default 16"),
        Field("logprobs", _int(minimum=0), "top-n log probabilities per token; at most --max-logprobs"),
        Field("echo", BOOL, "the prompt's text starts each choice"),
        Field("best_of", _int(minimum=1), "samples per prompt, the n likeliest returned; at least n"),
        *COMMON,
        *SAMPLING,
    ),
    "chat": (
        Field("messages", {"type": "array", "minItems": 1, "items": MESSAGE}, "the conversation", required=True),
        Field("tools", {"type": "array", "items": TOOL}, "functions the model may call"),
        Field("tool_choice", _TOOL_CHOICE, "none, auto, required or a named function"),
        Field("parallel_tool_calls", BOOL, "default true"),
        Field("logprobs", BOOL, "log probabilities of each token"),
        Field("top_logprobs", _int(minimum=0), "with logprobs: the top-n alternatives; at most --max-logprobs"),
        Field("max_tokens", _MAX_TOKENS, "default: up to the context length"),
        Field("max_completion_tokens", _MAX_TOKENS, "OpenAI's newer name of max_tokens; wins over it"),
        Field("add_generation_prompt", BOOL, "default true"),
        Field("best_of", _int(minimum=1, maximum=1), "a completions field; here 1 or null only"),
        *COMMON,
        *SAMPLING,
    ),
    "tokenize": (
        Field("prompt", STRING, "text (or send messages)"),
        Field("messages", {"type": "array", "minItems": 1, "items": MESSAGE}, "chat messages, rendered as chat does"),
        Field("add_generation_prompt", BOOL, "with messages; default true"),
        Field("tools", {"type": "array", "items": TOOL}, "with messages: as the chat template gets them"),
        Field("add_special_tokens", BOOL, "default true for prompt, false for messages"),
        Field("model", STRING, "the served model or a LoRA adapter"),
    ),
    "detokenize": (
        Field("tokens", _TOKEN_IDS, "token ids below the vocabulary size", required=True),
        Field("model", STRING, "the served model or a LoRA adapter"),
    ),
    "load_lora_adapter": (
        Field("lora_name", {**_SPEC, "maxLength": 256}, "the name requests give as model", required=True),
        Field("lora_path", {**_SPEC, "maxLength": 4096}, "the adapter's folder on the workers", required=True),
    ),
    "unload_lora_adapter": (Field("lora_name", _SPEC, "a runtime-loaded adapter", required=True),),
}

_PYTHON_TYPES = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),  # bool is an int to Python, not to JSON
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_ARTICLE = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "a boolean"}
_ARTICLE |= {"array": "an array", "object": "an object"}
_INDEX = {endpoint: {f.name: f for f in fields} for endpoint, fields in BODIES.items()}
_LOGGED_UNKNOWN: set[str] = set()  # each ignored name is logged once per process, whatever clients send
_MAX_LOGGED = 256


def json_type(value) -> str:
    for name, test in _PYTHON_TYPES.items():
        if test(value):
            return name
    return "null" if value is None else type(value).__name__


def check(endpoint: str, body: dict) -> None:
    """Each known field's JSON type, a 400 naming the first wrong one; null
    is "not set" (the parser's default). Unknown fields are ignored, as
    OpenAI's and vLLM's servers do (newer clients keep working), and logged."""
    fields = _INDEX[endpoint]
    unknown = []
    for name, value in body.items():
        f = fields.get(name)
        if f is None:
            unknown.append(name)
            continue
        if value is None:
            continue
        types = f.schema["type"]
        types = (types,) if isinstance(types, str) else types
        if not any(_PYTHON_TYPES[t](value) for t in types):
            expect = f.expect or " or ".join(_ARTICLE[t] for t in types)
            raise InvalidRequestError(f"{name} must be {expect}, got {json_type(value)}", field=name)
    if unknown:
        _log_unknown(endpoint, unknown)


def _log_unknown(endpoint: str, names: list[str]) -> None:
    new = [n for n in names if n not in _LOGGED_UNKNOWN]
    if not new or len(_LOGGED_UNKNOWN) >= _MAX_LOGGED:
        return
    _LOGGED_UNKNOWN.update(new[: _MAX_LOGGED - len(_LOGGED_UNKNOWN)])
    shown = ", ".join(repr(n[:40]) for n in new[:8])  # %r-style: one line whatever the client sent
    logger.warning("%s: ignoring fields this server does not know: %s", endpoint, shown)
