"""One request inside the engine: its tokens, progress and KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.proto.block_hash import chain_hashes
from shoal.proto.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.proto.messages import GenerateRequest

# Async scheduling: the next step is scheduled while this one computes, so a sequence due a
# token holds this in its place until the token is sampled (vLLM's output placeholders). Never
# a real id: a step that ran with one unreplaced fails in the embedding rather than run on.
PLACEHOLDER_TOKEN_ID = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds blocks a KV connector is loading (vLLM's name)
    FINISHED = "finished"


@dataclass(slots=True)
class RequestTimings:
    """Wall-clock instants (time.time()) of a request's milestones."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    # Each preemption and each return to the running batch (the trace's events).
    preempted: list[float] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Sequence:
    """token_ids holds the prompt followed by every generated token.

    num_computed_tokens counts the tokens whose keys and values are in the KV
    cache; the scheduler's work for a sequence is always the tokens from there
    to the end, so a prefill, a prefill chunk, a decode and a recompute after
    preemption are the same thing. Only the scheduler changes its progress
    and status (Scheduler.update_from_output after each step).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_order: int
    priority: int
    timings: RequestTimings
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_expected_prefill: int = 0  # tokens it was expected to prefill when it arrived (the cache then less)
    block_table: list[int] = field(default_factory=list)
    # Prefix-cache keys of its full blocks (block_hash.py), extended as blocks fill; the prompt's may come
    # precomputed from the router (block_hash.adopt_chain).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already in the prefix index
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    sampling_seed: int | None = None  # set for sampled requests: with the output index, fixes each draw
    block_hash_extra: bytes = b""  # salts every block's key: what else changes its contents (the LoRA adapter)
    # The request's cache_salt (block_hash.root_key): only sequences with the same one share prefix blocks.
    cache_salt: str | None = None
    # Its grammar's matcher (structured_output/request.py), when its output is constrained. Not part of
    # any block's key: only sampled tokens are constrained, so a prompt's blocks are the same either way.
    structured_output_request: object | None = None
    # Its parallel-sampling group (n > 1: the router's siblings of one prompt share this key): a member
    # waits until another has computed the prompt, then takes that one's full prompt blocks.
    parent_request_id: str | None = None
    # The LoRA adapter it runs under (workers/lora/; None: the base model), and the device slot the
    # scheduler's table gave it while it holds one (from admission until it finishes or is preempted).
    lora_request: object | None = None
    lora_slot: int | None = None
    # The request as it came, whole: a field the router adds reaches the scheduler here, unspelled.
    request: GenerateRequest | None = None
    # What a KV connector's request_finished said of its blocks for whoever receives them (vLLM's name).
    kv_transfer_params: dict | None = None
    # Its full blocks' sequence hashes in NVIDIA Dynamo's format (--kv-events-block-hash dynamo), as far as made.
    dynamo_hashes: list[int] = field(default_factory=list)
    # Trailing token_ids that are PLACEHOLDER_TOKEN_ID: tokens of steps in flight (async scheduling).
    num_output_placeholders: int = 0

    @classmethod
    def from_request(cls, request: GenerateRequest, arrival_order: int) -> Sequence:
        """The sequence of a checked request (LLMEngine.add_request). A
        failover's last num_resumed_tokens prompt ids are output already."""
        ids = request.prompt_token_ids
        return cls(
            request.request_id,
            list(ids),
            len(ids) - request.num_resumed_tokens,
            request.params,
            arrival_order,
            request.priority,
            RequestTimings(time.time()),
            cache_salt=request.cache_salt,
            parent_request_id=request.parent_request_id,
            request=request,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, counting those of steps in flight (what the next draw's index is)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far (not counting placeholders): what a delta reports."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_output_placeholders

    def drop_placeholders(self) -> None:
        """Forget the tokens of steps in flight (it finished: they are not its)."""
        if self.num_output_placeholders:
            del self.token_ids[-self.num_output_placeholders :]
            self.num_output_placeholders = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def prefix_keys(self, block_size: int, n: int) -> list[bytes]:
        """Its prefix-cache keys, at least its first n if it has n full blocks
        (block_hash.chain_hashes, under its salts): computed once, kept in block_hashes."""
        hashes = self.block_hashes
        if len(hashes) < n:
            chain_hashes(self.token_ids, block_size, hashes, self.block_hash_extra, n, self.cache_salt)
        return hashes

    def sort_key(self) -> tuple[int, int]:
        """Smaller goes first: lower priority value, then earlier arrival."""
        return (self.priority, self.arrival_order)
