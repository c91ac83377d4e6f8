"""Per-request sampling parameters, named as in vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shoal.proto.errors import InvalidRequestError
from shoal.proto.logit_bias import LogitBias
from shoal.proto.structured_params import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. top_k -1 and top_p 1 and min_p 0 disable those
    filters. `seed` gives the same tokens whatever else shares the batch.
    `logprobs=n` returns the top-n log probabilities of every sampled token
    (taken from the raw model distribution, as vLLM does).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> a number in [-100, 100] added to its logit (OpenAI's logit_bias): a
    # dict given here becomes a LogitBias, checked once, which copies of the params share
    logit_bias: LogitBias | dict[int, float] | None = None
    # what the output must match (a JSON schema, a regex, a grammar...): the sampler masks the rest
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)) or self.stop is None:
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.logit_bias:
            self.logit_bias = None
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below vLLM's epsilon, dividing the logits would overflow them: argmax is what is meant.
        return self.temperature < SAMPLING_EPS

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field. Every field
        is checked for its type as well as its range: a SamplingParams may
        come from anywhere (a pickle, a test, a client's JSON)."""

        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name} {why}, got {_show(getattr(self, name))}", field=name)

        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not _is_int(v) and not (v is None and name in ("seed", "logprobs")):
                bad(name, "must be an integer")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
                bad(name, "must be a finite number")  # in float32, as the sampler holds it
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        if self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        # Above the vocabulary top_k keeps every token: the sampler clamps it (as vLLM does).
        if self.top_k < -1 or self.top_k == 0:
            bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be an integer >= 0")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            bad("seed", "must be in [-2**63, 2**64)")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None and type(self.logit_bias) is not LogitBias:
            # checked (and frozen) here once; a LogitBias was checked when made
            self.logit_bias = LogitBias(self.logit_bias) if self.logit_bias != {} else None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be StructuredOutputsParams")
            # The shape here; the spec itself is checked where it is compiled, off any
            # event loop (the router's spec-check pool, the worker's grammar threads).
            self.structured_outputs.check_shape()


SAMPLING_EPS = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38
MAX_REPETITION_PENALTY = 100.0
_INT_FIELDS = ("max_tokens", "top_k", "min_tokens", "seed", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_int(x: object) -> bool:
    return type(x) is int  # not bool, not a subclass that compares oddly


def _is_number(x: object) -> bool:
    return type(x) in (int, float)


def _show(value: object) -> str:
    text = repr(value)  # a hostile value may be huge: the message names it, briefly
    return text if len(text) <= 80 else text[:77] + "..."
