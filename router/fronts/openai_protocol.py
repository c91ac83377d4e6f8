"""OpenAI request bodies -> the router's Prompt and sampling fields.

Every known field is type-checked and a bad one raises InvalidRequestError
naming it (HTTP 400, `param` set). Unknown fields are ignored, as OpenAI's
own server and vLLM's do, so newer clients keep working (and logged).
Which fields each endpoint has, and their JSON types, is request_schema.py's
table, which the OpenAPI document is built from.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.proto.block_hash import check_cache_salt
from shoal.proto.errors import InvalidRequestError
from shoal.proto.logit_bias import DEFAULT_MAX_LOGIT_BIAS, LogitBias, check_count
from shoal.router.fronts import request_schema
from shoal.router.fronts.prompt import Prompt
from shoal.router.fronts.request_schema import MAX_USER_LEN
from shoal.router.fronts.structured_fields import parse_structured
from shoal.router.fronts.tools import ToolChoice, constrain_sampling, parse_messages, parse_tools

_NUMBER = (int, float)


def _get(body: dict, name: str, types, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int to Python, never to a JSON schema
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise InvalidRequestError(f"{name} must be {_type_name(types)}, got a boolean", field=name)
    if not isinstance(value, types):
        raise InvalidRequestError(f"{name} must be {_type_name(types)}, got {type(value).__name__}", field=name)
    return value


def _type_name(types) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    types = types if isinstance(types, tuple) else (types,)
    if types == _NUMBER:
        return "a number"
    return " or ".join(names.get(t, t.__name__) for t in types)


@dataclass(slots=True)
class ParsedRequest:
    """What both endpoints share once the body is read."""

    prompts: list[Prompt]
    sampling: dict  # SamplingParams fields; max_tokens None = up to the context length
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    echo: bool = False  # completions: the prompt's text starts each choice
    user: str | None = None  # logged with the request id, never a key
    num_prompt_tokens: list[int] | None = None  # per prompt, once tokenized
    echo_texts: list[str] | None = None  # per prompt, once tokenized, when echo
    tool_choice: ToolChoice | None = None  # chat with tools: how the reply is read (tool_replies.py)
    n: int = 1  # choices per prompt (parallel samples; router/fronts/parallel_sampling.py)
    best_of: int | None = None  # completions: samples per prompt, of which the n likeliest are returned
    lora_name: str | None = None  # the LoRA adapter `model` names, once resolved (None: the base model)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks


def _sampling(body: dict, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> dict:
    s: dict = {}
    for name, types in (
        ("temperature", _NUMBER),
        ("top_p", _NUMBER),
        ("min_p", _NUMBER),
        ("presence_penalty", _NUMBER),
        ("frequency_penalty", _NUMBER),
        ("repetition_penalty", _NUMBER),
        ("top_k", int),
        ("seed", int),
        ("min_tokens", int),
        ("ignore_eos", bool),
        ("skip_special_tokens", bool),
    ):
        v = _get(body, name, types)
        if v is not None:
            s[name] = float(v) if types is _NUMBER else v
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise InvalidRequestError("stop must be a string or an array of strings", field="stop")
        s["stop"] = stop
    ids = _get(body, "stop_token_ids", list)
    if ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("stop_token_ids must be an array of integers", field="stop_token_ids")
        s["stop_token_ids"] = ids
    bias = _get(body, "logit_bias", dict)
    if bias:
        s["logit_bias"] = _logit_bias(bias, max_logit_bias)
    structured = parse_structured(body)
    if structured is not None:
        s["structured_outputs"] = structured
    return s


def _logit_bias(bias: dict, limit: int) -> LogitBias:
    """OpenAI's map of token ids (JSON keys are strings) to numbers, at most
    `limit` entries (--max-logit-bias, counted before any is read), checked
    once for the whole request (its prompts and samples share the LogitBias);
    the engine's check bounds the ids by the vocabulary."""
    check_count(len(bias), limit)
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key[:40]!r}", field="logit_bias")
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise InvalidRequestError("logit_bias values must be numbers", field="logit_bias")
        out[int(key)] = float(value)
    return LogitBias(out)


def _common(body: dict, prompts: list[Prompt], max_tokens: int | None, sampling: dict) -> ParsedRequest:
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict)
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", field="stream_options")
        include_usage = _get(opts, "include_usage", bool, False)
        # As vLLM: usage on every chunk only together with include_usage.
        continuous = _get(opts, "continuous_usage_stats", bool, False) and include_usage
    user = _get(body, "user", str)
    if user is not None and len(user) > MAX_USER_LEN:
        raise InvalidRequestError(f"user has {len(user)} characters; at most {MAX_USER_LEN} are allowed", field="user")
    parsed = ParsedRequest(prompts, sampling, stream, include_usage, _get(body, "model", str))
    parsed.continuous_usage, parsed.user = continuous, user
    parsed.cache_salt = body.get("cache_salt")
    check_cache_salt(parsed.cache_salt)
    parsed.n = _get(body, "n", int, 1)  # its upper bound is the engine's --max-n (parallel_sampling.py)
    if parsed.n < 1:
        raise InvalidRequestError(f"n must be at least 1, got {parsed.n}", field="n")
    parsed.best_of = _get(body, "best_of", int)  # completions only (parallel_sampling.py refuses it on chat)
    if parsed.best_of is not None:
        if parsed.best_of < parsed.n:
            raise InvalidRequestError(f"best_of must be at least n ({parsed.n}), got {parsed.best_of}", field="best_of")
        if stream and parsed.best_of > parsed.n:  # OpenAI's rule: only finished samples can be ranked
            raise InvalidRequestError("best_of greater than n cannot be streamed", field="best_of")
    return parsed


def parse_completion(body: dict, max_prompts: int = 64, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> ParsedRequest:
    """POST /v1/completions. `prompt` is a string, token ids, or a list of
    at most max_prompts (--max-prompts) of either."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    request_schema.check("completions", body)
    raw = body.get("prompt")
    if raw is None:
        raise InvalidRequestError("prompt is required", field="prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_int(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError(
            "prompt must be a string, an array of token ids, or a non-empty array of those", field="prompt"
        )
    if len(raw) > max_prompts:
        raise InvalidRequestError(
            f"prompt holds {len(raw)} prompts; at most {max_prompts} are allowed in one request (--max-prompts)",
            field="prompt",
        )
    prompts = []
    for p in raw:
        if isinstance(p, str):
            prompts.append(Prompt(text=p))
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            prompts.append(Prompt(token_ids=list(p)))
        else:
            raise InvalidRequestError("each prompt must be a string or an array of token ids", field="prompt")
    if _get(body, "suffix", str):
        raise InvalidRequestError("suffix is not supported", field="suffix")
    sampling = _sampling(body, max_logit_bias)
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None:  # its upper bound is the engine's --max-logprobs (request_checks)
        sampling["logprobs"] = logprobs
    echo = _get(body, "echo", bool, False)
    if echo and logprobs is not None:  # vLLM then returns the prompt's logprobs, which the engine does not make
        raise InvalidRequestError("echo together with logprobs is not supported", field="echo")
    parsed = _common(body, prompts, _get(body, "max_tokens", int, 16), sampling)
    parsed.echo = echo
    return parsed


def parse_chat(body: dict, max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS) -> ParsedRequest:
    """POST /v1/chat/completions. Content may be a string or text parts;
    tools and tool calls as tools.py reads them."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    request_schema.check("chat", body)
    rendered = parse_messages(body.get("messages"))
    tools, choice = parse_tools(body)
    sampling = _sampling(body, max_logit_bias)
    constrain_sampling(sampling, tools, choice, "tool_choice")
    if _get(body, "logprobs", bool, False):
        top = _get(body, "top_logprobs", int, 0)
        if top < 0:
            raise InvalidRequestError("top_logprobs must be >= 0", field="top_logprobs")
        sampling["logprobs"] = top
    elif body.get("top_logprobs") is not None:
        raise InvalidRequestError("top_logprobs needs logprobs=true", field="top_logprobs")
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    add_gen = _get(body, "add_generation_prompt", bool, True)
    prompt = Prompt(messages=rendered, add_generation_prompt=add_gen, tools=tools)
    parsed = _common(body, [prompt], max_tokens, sampling)
    parsed.tool_choice = choice
    return parsed


def parse_tokenize(body: dict) -> tuple[Prompt, str | None]:
    """POST /tokenize (vLLM's): `prompt` text (`add_special_tokens`, default
    true), or chat `messages` rendered as the chat endpoint renders them
    (`add_generation_prompt`, default true; `add_special_tokens` default false)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    request_schema.check("tokenize", body)
    special = _get(body, "add_special_tokens", bool)
    if body.get("messages") is not None:
        chat = {k: body[k] for k in ("messages", "add_generation_prompt", "tools") if k in body}
        prompt = parse_chat(chat).prompts[0]
    else:
        prompt = Prompt(text=_get(body, "prompt", str))
        if prompt.text is None:
            raise InvalidRequestError("prompt (a string) or messages is required", field="prompt")
        parse_tools({"tools": body.get("tools")})  # unused by a text prompt, but checked as the document says
    prompt.add_special_tokens = special
    return prompt, _get(body, "model", str)


def parse_detokenize(body: dict) -> tuple[list[int], str | None]:
    """POST /detokenize (vLLM's): `tokens`, an array of token ids; the
    vocabulary bound is the Frontend's."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    request_schema.check("detokenize", body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise InvalidRequestError("tokens must be an array of token ids (integers)", field="tokens")
    return tokens, _get(body, "model", str)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
