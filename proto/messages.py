"""The messages between the router and its workers.

They are dataclasses that Ray pickles on their way between the router's and
a worker's processes (a SamplingParams rides inside GenerateRequest the same
way); in-process pools hand them over as they are. The router imports this
module; the workers never import the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shoal.proto.logprobs import TokenLogprob
from shoal.proto.sampling_params import SamplingParams
from shoal.proto.stats import EngineStats


@dataclass(slots=True)
class GenerateRequest:
    """Router -> worker: one prompt to generate from."""

    request_id: str  # the engine's id, made by the router; the response id clients see
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    client_request_id: str | None = None  # the client's own id: logged and echoed, never a key
    # The prompt's prefix-cache chain (block_hash.chain_hashes), computed once
    # by the router, which scores replicas by it.
    block_hashes: list[bytes] | None = None
    # Failover (router/routing/failover.py): the last num_resumed_tokens of
    # prompt_token_ids are output a lost worker already streamed, of whose
    # text the client has num_resumed_chars characters. The engine counts them
    # as output (budget, min_tokens, seed index, stops) and streams the rest.
    num_resumed_tokens: int = 0
    num_resumed_chars: int = 0
    # The sending router's delta stream (Subscribe.router): while it is
    # subscribed at the worker, this request's deltas ride on it.
    mux: str | None = None
    # The router's span (W3C traceparent/tracestate), when tracing is on:
    # the worker's span for the request is its child.
    trace_context: dict[str, str] | None = None
    # Parallel sampling (n > 1): the first sibling's request id, carried by
    # every sibling of one prompt (the first too). The router sends them all
    # to one worker, whose engine prefills the prompt once for them.
    parent_request_id: str | None = None
    # The LoRA adapter it runs under, by the name it is served as (never a
    # path: the worker knows its adapters); None is the base model.
    lora_name: str | None = None
    # Salts the prompt's prefix-cache chain (block_hash.root_key), block_hashes
    # included: only requests with the same salt share KV blocks. The client's
    # cache_salt, folded with its identity under --cache-isolation key.
    cache_salt: str | None = None

    @property
    def log_name(self) -> str:
        """How logs name the request: the engine's id, the client's beside it."""
        if self.client_request_id is None:
            return f"request {self.request_id}"
        return f"request {self.request_id} (client id {self.client_request_id!r})"


@dataclass(slots=True)
class RequestFinished:
    """On a request's last delta: why and how it ended."""

    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: str | int | None  # the stop string or token id that ended it
    worker: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    queue_s: float  # arrival at the worker -> first scheduled
    prefill_s: float = 0.0  # first scheduled -> first token, in the engine
    decode_s: float = 0.0  # first token -> last, in the engine
    # Filled in by the router, which sees the request arrive and end.
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class GenerateDelta:
    """Worker -> router: what a request produced since its last delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked
    finished: RequestFinished | None = None  # set on the last delta only
    # The worker's load after the step that made this delta: the router's
    # freshest view of it (the same object rides on every delta of a step).
    load: WorkerLoad | None = None


@dataclass(slots=True)
class Subscribe:
    """Router -> one worker replica: open the router's delta stream there
    (workers/delta_outbox.py). It yields lists of (request id, delta), one
    per engine step, for every request of the router's riding on it."""

    router: str  # the router's id, as its requests carry it in GenerateRequest.mux
    replica: str  # the worker replica it is meant for (its Worker.name)


@dataclass(slots=True)
class Riding:
    """Worker -> router, first on a request's own stream when its deltas
    ride on the router's delta stream instead: the request's own stream
    then carries only a refusal (WorkerError), and ends."""

    worker: str  # the worker's name (its Serve replica id)


@dataclass(slots=True)
class WorkerError:
    """Worker -> router, instead of any delta: the request was refused."""

    # "full" (429 / RESOURCE_EXHAUSTED), "invalid" (400 / INVALID_ARGUMENT),
    # "failed" (500: the request alone failed in the engine); for the router
    # to act on: "unavailable" (the engine was dead already: not taken),
    # "died" (the engine died holding it), "moved" (handed back unrun);
    # LoRA: "not_found" (404: no adapter by that name), "conflict" (409)
    kind: str
    message: str
    field: str | None = None  # the request field at fault, for "invalid"
    code: str | None = None  # a finer reason for the client (e.g. "poisoned_request")


@dataclass(slots=True)
class WorkerInfo:
    """What the router needs to know of the model a worker serves."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    tensor_parallel_size: int
    worker: str
    max_logprobs: int = 20  # the engine's per-request limits, which the router checks too
    max_stop_strings: int = 64
    max_n: int = 16
    grammar_compile_timeout_s: float = 10.0
    enable_lora: bool = False
    max_loras: int = 0  # adapters one step may use (0: LoRA off)
    # The adapters it serves by name (--lora-modules and runtime loads) -> lora_int_id.
    loras: dict[str, int] = field(default_factory=dict)
    max_logit_bias: int = 300  # --max-logit-bias, which the router checks too


@dataclass(slots=True)
class WorkerLoad(EngineStats):
    """A worker's engine stats (running, waiting, free blocks, ...), read at
    the moment it is asked, its name and that moment: the one load report,
    on a step's deltas, on the stats broadcast, and (as a dict, for Ray Serve)
    on the routing-stats poll. The block size is not in it: WorkerInfo has it."""

    worker: str
    time: float = 0.0  # wall time the figures were read
    # LoRA (--enable-lora): each adapter served by name -> (lora_int_id, where
    # it is: proto/lora/modules.py's LORA_ON_DEVICE, LORA_IN_HOST or
    # LORA_ON_DISK), and the adapters of the running and the waiting requests.
    loras: dict[str, tuple[int, int]] = field(default_factory=dict)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # KV tiers (--kv-offload-*): each tier's counters (hit_tokens, query_tokens, loaded_blocks,
    # saved_blocks, evicted_blocks, failed_blocks, used_blocks, total_blocks, bytes_per_block,
    # load_us, and load_buckets: a list, its loads counted by time taken), by tier.
    kv_tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What a prefilled token costs there, measured over its steps (0.0: not yet): against
    # a tier's load_us per block, what the router's kv policy weighs a tier's hit by.
    prefill_us_per_token: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerLoad:
        """The report back from `dataclasses.asdict` (Serve's poll carries a
        dict), ignoring what else the dict carries."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})
