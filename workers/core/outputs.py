"""What a step hands back: the model runner's sampled tokens to the
scheduler, and the engine's deltas (one per request per step) and whole
outputs (for the offline front)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.proto.logprobs import TokenLogprob
from shoal.workers.core.sequence import RequestTimings, Sequence


@dataclass(slots=True)
class KVConnectorOutput:
    """What a KV connector's worker side finished since it was last asked (vLLM's name)."""

    finished_recving: set[str] = field(default_factory=set)  # requests whose asynchronous loads are in place
    failed_recving: set[str] = field(default_factory=set)  # ...whose loads failed: their blocks are computed
    finished_sending: set[str] = field(default_factory=set)  # ended requests whose blocks may now be freed
    # Each load made since, by tier: (blocks, seconds) (the connector's counters and costs).
    kv_connector_stats: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_recving or self.failed_recving or self.finished_sending or self.kv_connector_stats)


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's sampling, a row per sequence due a token; the runner
    changes no sequence (Scheduler.update_from_output does)."""

    seqs: list[Sequence]
    sampled_token_ids: list[int]
    # per row: None, or (sampled token's logprob, {token_id: logprob} of the top n)
    logprobs: list[tuple[float, dict[int, float]] | None]
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class RequestOutput:
    """A delta: the tokens and text produced since the last one. The last
    delta of a request has finish_reason set ('stop', 'length', 'abort' or 'error')."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    timings: RequestTimings
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None  # finish_reason "error": this request failed alone (LLMEngine._fail)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one, so a consumer
        that fell behind gets one message instead of several."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.error = later.error
        self.num_cached_tokens, self.num_output_tokens = later.num_cached_tokens, later.num_output_tokens
        self.timings = later.timings


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one prompt (LLM.generate)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    timings: RequestTimings | None = None

    def add(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.finish_reason = delta.finish_reason
        self.timings = delta.timings
