"""The one check every request passes: at the router, for a clear early
error, and again in the engine, which trusts nobody. Both import this
function, so the rules are written once. No torch here: the router's
processes import it (numpy is fine there)."""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from typing import cast

import numpy as np

from shoal.proto.errors import InvalidRequestError
from shoal.proto.logit_bias import DEFAULT_MAX_LOGIT_BIAS, LogitBias, check_count
from shoal.proto.sampling_params import SamplingParams

MAX_STOP_STRING_CHARS = 1024


def check_request_id(request_id: object, in_use: Container[str]) -> None:
    """A request id is a non-empty string no request in flight has."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
    if request_id in in_use:
        raise InvalidRequestError(f"request_id {request_id[:64]!r} is already in use", field="request_id")


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """What the served model and the operator's flags allow one request."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20  # --max-logprobs
    max_stop_strings: int = 64  # --max-stop-strings (stop strings, and stop token ids)
    max_n: int = 16  # --max-n (parallel samples of one request)
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS  # --max-logit-bias (entries in one request's logit_bias)


def check_request(
    prompt_ids: list[int], params: SamplingParams, limits: RequestLimits, num_resumed_tokens: int = 0
) -> None:
    """Raise InvalidRequestError naming the first bad field. The ids' last
    num_resumed_tokens are output made already (a failover); the rest is
    the prompt. Only checks: nothing is changed."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling parameters must be SamplingParams, got {type(params).__name__}")
    params.validate()
    vocab = limits.vocab_size
    if not isinstance(prompt_ids, list) or not prompt_ids:
        raise InvalidRequestError("prompt is empty", field="prompt")
    try:  # in C: a non-integer or an id past int64 raises here (a Python loop took 20 us a 1,000 ids)
        packed = np.frombuffer(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids), np.int64)
    except struct.error:
        raise InvalidRequestError("prompt must be token ids (integers)", field="prompt") from None
    if packed.min() < 0 or packed.max() >= vocab:
        raise InvalidRequestError(f"prompt holds token ids outside the vocabulary [0, {vocab})", field="prompt")
    if type(num_resumed_tokens) is not int or not 0 <= num_resumed_tokens < len(prompt_ids):
        raise InvalidRequestError(
            f"num_resumed_tokens must be in [0, {len(prompt_ids)}), got {num_resumed_tokens!r}",
            field="num_resumed_tokens",
        )
    if num_resumed_tokens >= params.max_tokens:
        raise InvalidRequestError(
            f"{num_resumed_tokens} tokens were made already; max_tokens is {params.max_tokens}", field="max_tokens"
        )
    n, limit = len(prompt_ids) - num_resumed_tokens, limits.max_model_len
    if n >= limit:
        raise InvalidRequestError(f"prompt has {n} tokens; max_model_len is {limit}", field="prompt")
    if n + params.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({limit})",
            field="max_tokens",
        )
    _check_limits(params, limits)


def _check_limits(params: SamplingParams, limits: RequestLimits) -> None:
    vocab = limits.vocab_size
    if any(t >= vocab for t in params.stop_token_ids):
        raise InvalidRequestError(
            f"stop_token_ids holds ids outside the vocabulary [0, {vocab})", field="stop_token_ids"
        )
    if params.logit_bias:  # a LogitBias once validated: O(1) here
        check_count(len(params.logit_bias), limits.max_logit_bias)
        if cast(LogitBias, params.logit_bias).max_token_id >= vocab:
            raise InvalidRequestError(f"logit_bias has keys outside the vocabulary [0, {vocab})", field="logit_bias")
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise InvalidRequestError(
            f"logprobs must be at most {limits.max_logprobs} (--max-logprobs), got {params.logprobs}", field="logprobs"
        )
    for name in ("stop", "stop_token_ids"):
        if len(getattr(params, name)) > limits.max_stop_strings:
            raise InvalidRequestError(
                f"{name} has {len(getattr(params, name))} entries; at most "
                f"{limits.max_stop_strings} are allowed (--max-stop-strings)",
                field=name,
            )
    if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise InvalidRequestError(f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters", field="stop")
