"""The OpenAPI 3.1 document of the HTTP API, served at GET /openapi.json.
Request bodies come from request_schema.py's table (the one the parsers
consult) and the error statuses from the app's own error table, so the
document says what the server does."""

from __future__ import annotations

import copy

from shoal.router.fronts.request_schema import BODIES, Field

# endpoint -> (path, method, summary, the table's body or None, 200's media types, whether the key is needed)
_TEXT = "text/plain"
OPERATIONS = (
    ("/v1/completions", "post", "Text completions (OpenAI's)", "completions", "completion", True),
    ("/v1/chat/completions", "post", "Chat completions (OpenAI's)", "chat", "chat", True),
    ("/v1/models", "get", "The served model and its LoRA adapters", None, "models", True),
    ("/health", "get", "200 while this router can route to a worker (?all=1: to every worker)", None, "health", False),
    ("/tokenize", "post", "Token ids of a prompt or chat (vLLM's)", "tokenize", "tokenize", True),
    ("/detokenize", "post", "Text of token ids (vLLM's)", "detokenize", "detokenize", True),
    ("/v1/load_lora_adapter", "post", "Load a LoRA adapter at runtime (vLLM's)", "load_lora_adapter", _TEXT, True),
    ("/v1/unload_lora_adapter", "post", "Unload a runtime LoRA adapter (vLLM's)", "unload_lora_adapter", _TEXT, True),
    ("/metrics", "get", "Prometheus metrics", None, _TEXT, False),
    ("/openapi.json", "get", "This document", None, "openapi", False),
)
_OBJ = {"type": "object"}
_INT, _STR = {"type": "integer"}, {"type": "string"}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
}


def _completion(choice_keys: list[str]) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": _STR,
            "object": _STR,
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": {"type": "object", "required": ["index", *choice_keys], "properties": {"index": _INT}},
            },
            "usage": _USAGE,
        },
    }


RESPONSES = {
    "completion": _completion(["text", "finish_reason"]),
    "chat": _completion(["message", "finish_reason"]),
    "models": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "max_model_len"],
                    "properties": {"id": _STR, "object": {"const": "model"}, "parent": {"type": ["string", "null"]}},
                },
            },
        },
    },
    "health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"enum": ["ok", "not ready", "draining"]}, "workers": _INT, "num_workers": _INT},
    },
    "tokenize": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT}},
    },
    "detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "openapi": {"type": "object", "required": ["openapi", "paths"]},
}
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk (JSON) or an error, then [DONE] last"}},
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"], "description": "the request field at fault"},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def body_schema(endpoint: str) -> dict:
    """A request body's JSON Schema: the table's fields, null allowed for
    every optional one (it means "not set"), unknown fields allowed (ignored)."""
    fields: tuple[Field, ...] = BODIES[endpoint]
    props = {}
    for f in fields:
        s = copy.deepcopy(f.schema)
        if not f.required:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            s["type"] = [*types, "null"]
        if f.description:
            s["description"] = f.description
        props[f.name] = s
    required = [f.name for f in fields if f.required]
    return {"type": "object", "properties": props, **({"required": required} if required else {})}


def _operation(summary, endpoint, answer, secured: bool, error_statuses: dict[int, str]) -> dict:
    if answer == _TEXT:
        ok: dict[str, dict[str, object]] = {_TEXT: {"schema": _STR}}
    else:
        ok = {"application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}}}
        if endpoint in ("completions", "chat"):  # stream=true: the schema is each event's (OpenAPI 3.1)
            ok["text/event-stream"] = {"schema": SSE_EVENT}
    op: dict = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok}}}
    for status in error_statuses:
        op["responses"][str(status)] = {"$ref": f"#/components/responses/e{status}"}
    if answer == "health":  # not ready or draining: the health body, not an error's
        op["responses"]["503"] = {"description": "no worker to route to, or draining", "content": ok}
        op["parameters"] = [
            {"name": "all", "in": "query", "required": False, "schema": {"type": "string"}, "description": "1: all"}
        ]
    if endpoint is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{endpoint}_request"}}},
        }
    op["security"] = [{"bearer": []}] if secured else []
    return op


def document(error_statuses: dict[int, str], version: str) -> dict:
    """error_statuses: every HTTP error status the app answers -> why."""
    paths: dict = {}
    for path, method, summary, endpoint, answer, secured in OPERATIONS:
        paths.setdefault(path, {})[method] = _operation(summary, endpoint, answer, secured, error_statuses)
    schemas = {f"{e}_request": body_schema(e) for e in BODIES}
    schemas |= copy.deepcopy(RESPONSES) | {"error": ERROR}
    responses = {
        f"e{status}": {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/error"}}},
        }
        for status, why in error_statuses.items()
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "shoal",
            "version": version,
            "description": "OpenAI-compatible HTTP API. Unknown request fields are ignored, as OpenAI's and vLLM's.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": responses,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}},
        },
        "security": [{"bearer": []}],
    }
