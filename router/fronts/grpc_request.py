"""A gRPC GenerateRequest read into what both fronts share: the Prompt, the
sampling fields (as openai_protocol makes them from JSON), the number of
choices and the tool choice. Tools and chat messages go through tools.py,
the HTTP front's reader, as the OpenAI dicts they mirror; every bad value is
a ServingError('invalid') naming its field."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shoal.proto.block_hash import check_cache_salt
from shoal.proto.errors import InvalidRequestError
from shoal.proto.logit_bias import DEFAULT_MAX_LOGIT_BIAS, LogitBias, check_count
from shoal.proto.structured_params import StructuredOutputsParams
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.router.fronts.frontend import ServingError
from shoal.router.fronts.prompt import Prompt
from shoal.router.fronts.tools import ToolChoice, constrain_sampling, parse_messages, parse_tools

_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
)


@dataclass(slots=True)
class ParsedGenerate:
    prompt: Prompt
    sampling: dict  # SamplingParams fields
    n: int = 1  # choices, each its own engine request
    tool_choice: ToolChoice | None = None  # chat with tools: how each choice's reply is read
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks


def parse_generate(
    request: pb.GenerateRequest, max_n: int, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
) -> ParsedGenerate:
    try:
        prompt = _prompt(request)
        sampling = _sampling(request.sampling, max_logit_bias)
        n = request.sampling.n if request.sampling.HasField("n") else 1
        if not 1 <= n <= max_n:
            raise InvalidRequestError(f"n must be in [1, {max_n}] (--max-n), got {n}", field="n")
        choice = _tools(request, prompt, sampling)
        cache_salt = request.cache_salt or None  # proto3: empty is unset
        check_cache_salt(cache_salt)
    except InvalidRequestError as e:
        raise ServingError("invalid", str(e), e.field) from None
    return ParsedGenerate(prompt, sampling, n, choice, cache_salt)


def parse_prompt(request) -> Prompt:
    """A GenerateRequest's or TokenizeRequest's prompt oneof."""
    try:
        return _prompt(request)
    except InvalidRequestError as e:
        raise ServingError("invalid", str(e), e.field) from None


def _prompt(request) -> Prompt:
    which = request.WhichOneof("prompt")
    if which == "text":
        return Prompt(text=request.text)
    if which == "token_ids":
        return Prompt(token_ids=list(request.token_ids.ids))
    if which == "chat":
        return Prompt(messages=parse_messages([_message(m) for m in request.chat.messages]))
    kinds = "text, token_ids or chat" if "token_ids" in type(request).DESCRIPTOR.fields_by_name else "text or chat"
    raise InvalidRequestError(f"a prompt is required: {kinds}", field="prompt")


def _message(m: pb.ChatMessage) -> dict:
    """The OpenAI message the proto mirrors; proto3's empty strings are unset."""
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_call(c) for c in m.tool_calls]
    return out


def _call(c: pb.ToolCall) -> dict:
    call = {"type": c.type or "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
    return {"id": c.id, **call} if c.id else call


def _sampling(sp: pb.SamplingParams, max_logit_bias: int) -> dict:
    out = {name: getattr(sp, name) for name in _SAMPLING_FIELDS if sp.HasField(name)}
    out.setdefault("max_tokens", 16)
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    if sp.logit_bias:  # counted first (--max-logit-bias), checked once; the engine bounds the ids too
        check_count(len(sp.logit_bias), max_logit_bias)
        out["logit_bias"] = LogitBias({int(t): float(b) for t, b in sp.logit_bias.items()})
    if (so := _structured_output(sp)) is not None:
        out["structured_outputs"] = so
    return out


def _structured_output(sp: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The oneof as the engine's params; its errors name `sampling.<kind>`."""
    kind = sp.WhichOneof("structured_output")
    if kind is None or (kind == "json_object" and not sp.json_object):  # false is the same as unset
        return None
    field = f"sampling.{kind}"
    if kind == "json_schema":
        return StructuredOutputsParams(json=sp.json_schema, field=field)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(sp.choice.choices), field=field)
    return StructuredOutputsParams(**{kind: getattr(sp, kind)}, field=field)


def _tools(request: pb.GenerateRequest, prompt: Prompt, sampling: dict) -> ToolChoice | None:
    """tools, tool_choice and parallel_tool_calls as the chat endpoint reads
    them; a "required" or named choice sets the reply's grammar."""
    fn = request.tool_choice_function
    if not (request.tools or request.tool_choice or fn or request.HasField("parallel_tool_calls")):
        return None
    if prompt.messages is None:
        field = "tools" if request.tools else "tool_choice"
        raise InvalidRequestError(f"{field}: tools need a chat prompt", field=field)
    body: dict = {"tools": [_tool(t, i) for i, t in enumerate(request.tools)] if request.tools else None}
    if fn:
        if request.tool_choice:
            raise InvalidRequestError(
                "tool_choice_function forces a call itself: leave tool_choice empty", field="tool_choice"
            )
        if fn not in {t.function.name for t in request.tools}:
            raise InvalidRequestError(
                f"tool_choice_function names {fn[:64]!r}, which is not in tools", field="tool_choice_function"
            )
        body["tool_choice"] = {"type": "function", "function": {"name": fn}}
    elif request.tool_choice:
        body["tool_choice"] = request.tool_choice
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    tools, choice = parse_tools(body)
    prompt.tools = tools
    constrain_sampling(sampling, tools, choice, "tool_choice_function" if fn else "tool_choice")
    return choice


def _tool(t: pb.Tool, i: int) -> dict:
    f = t.function
    function: dict = {"name": f.name}
    if f.description:
        function["description"] = f.description
    if f.parameters_json:
        try:
            function["parameters"] = json.loads(f.parameters_json)
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(
                f"tools[{i}]: function.parameters_json is not valid JSON: {e}", field="tools"
            ) from None
    return {"type": t.type or "function", "function": function}
