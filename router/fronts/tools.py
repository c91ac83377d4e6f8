"""Tools on the chat endpoint, request side: `tools`, `tool_choice` and
`parallel_tool_calls` read and checked; the JSON schema with which the grammar
enforces a "required" or named choice (vLLM's); and chat messages as the chat
template gets them, tool calls in the history and role "tool" replies included."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, cast

from shoal.proto.errors import InvalidRequestError
from shoal.proto.structured_params import StructuredOutputsParams

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MODES = ("none", "auto", "required")
# An empty parameters schema: the model writes `{}` and nothing more (vLLM's reply for a tool without parameters).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """What the reply may be. mode: auto (the --tool-call-parser reads the
    reply), required (a JSON array of calls), named (one function's arguments)."""

    mode: str
    name: str | None = None  # the function, when named
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply


def parse_tools(body: dict) -> tuple[list[dict] | None, ToolChoice | None]:
    """The tool definitions as the template gets them (as given) and the choice;
    (None, None) when the request has no tools or tool_choice "none" with none."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidRequestError("tools must be an array of tool definitions", field="tools")
    tools = [_tool(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is already defined", field="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", field="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return tools or None, None
    if raw is None:  # as vLLM: a choice of tools needs them
        raise InvalidRequestError("tool_choice needs tools: set tools, or leave tool_choice out", field="tool_choice")
    if isinstance(choice, str):
        if choice not in MODES:
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice[:40]!r}",
                field="tool_choice",
            )
        if not tools:  # required of no tools: none, as OpenAI (and vLLM) do
            return None, None
        return tools, ToolChoice(choice, parallel=parallel is not False)
    name = _named(choice)
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name[:64]!r}, which is not in tools", field="tool_choice")
    return tools, ToolChoice("named", name, parallel is not False)


def _tool(t, i: int) -> dict:
    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"tools[{i}]: {why}", field="tools")

    if not isinstance(t, dict):
        raise bad("a tool must be an object")
    if t.get("type", "function") != "function":  # vLLM takes a missing type as a function
        raise bad(f"only function tools are supported, got type {str(t.get('type'))[:40]!r}")
    f = t.get("function")
    if not isinstance(f, dict):
        raise bad("function must be an object with a name")
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad("function.name must be 1 to 64 letters, digits, underscores or dashes")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad("function.description must be a string")
    params = f.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise bad("function.parameters must be a JSON schema of an object")
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise bad("function.strict must be a boolean")
    return t


def _named(choice) -> str:
    f = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(f, dict):
        raise InvalidRequestError(
            'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            field="tool_choice",
        )
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise InvalidRequestError("tool_choice.function.name must be a non-empty string", field="tool_choice")
    return f["name"]


def choice_schema(tools: list[dict], choice: ToolChoice) -> dict | None:
    """The JSON schema the reply must match (vLLM's), None for auto: named, the
    function's arguments object; required, an array (of one without
    parallel_tool_calls) of {"name", "parameters"} objects, one shape per tool."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if choice.mode == "named":
        return by_name[choice.name].get("parameters") or NO_PARAMETERS
    if choice.mode != "required":
        return None
    defs: dict = {}
    shapes = []
    for name, f in by_name.items():
        params = copy.deepcopy(f.get("parameters")) or NO_PARAMETERS
        # "#/$defs/X" points at the root: a tool's definitions move up to the array's
        for key in ("$defs", "definitions"):
            for def_name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, sub) != sub:
                    raise InvalidRequestError(
                        f"tools: {key}/{def_name} has different schemas in two tools; tool_choice required needs one",
                        field="tools",
                    )
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}, **defs}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


# ---- messages ---------------------------------------------------------------


def constrain_sampling(sampling: dict, tools: list[dict] | None, choice: ToolChoice | None, field: str) -> None:
    """A required or named tool choice makes the reply's grammar (choice_schema):
    set it in the sampling fields, where no other structured output may be."""
    schema = None if choice is None else choice_schema(cast("list[dict]", tools), choice)  # a choice comes with tools
    if schema is None:
        return
    if "structured_outputs" in sampling:
        raise InvalidRequestError(
            "tool_choice required or a named function sets the reply's grammar itself; "
            f"it cannot be combined with {sampling['structured_outputs'].field}",
            field=field,
        )
    sampling["structured_outputs"] = StructuredOutputsParams(json=cast(str, schema), field=field)  # a dict: serialized


def parse_messages(messages) -> list[dict]:
    """Chat messages as the template gets them (transformers' way): role and
    content (text parts joined; null is ""), `name`, an assistant's
    `tool_calls` with JSON-object arguments as dicts (vLLM's, since templates
    write them with tojson), a tool reply's `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty array", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string role", field="messages")
        msg = {"role": m["role"], "content": _content(m.get("content"), i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_calls(m["tool_calls"], i)
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string", field="messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported", field="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or an array of text parts", field="messages")


def _history_calls(calls, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be an array", field="messages")
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(f.get("name"), str):
            raise InvalidRequestError(
                f'{where}[{k}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                field="messages",
            )
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise InvalidRequestError(f"{where}[{k}].id must be a string", field="messages")
        args = f.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise InvalidRequestError(f"{where}[{k}].function.arguments must be a JSON string", field="messages")
        if not args:
            args = {}
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):
                parsed = None
            args = parsed if isinstance(parsed, dict) else args  # not an object: the text as given
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if c.get("id") is not None:
            call = {"id": c["id"], **call}
        out.append(call)
    return out
