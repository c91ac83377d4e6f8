"""What AsyncEngine's callers queue for the engine-core thread, which applies
them between steps (vLLM v1's EngineCoreRequest and its abort and utility calls)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.workers.core.sampling_params import SamplingParams


@dataclass(slots=True)
class AddRequest:
    """LLMEngine.add_request's arguments; the prompt is tokenized and validated already."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    num_resumed_tokens: int = 0
    num_resumed_chars: int = 0
    block_hashes: list[bytes] | None = None
    grammar: object | None = None  # params.structured_outputs, compiled (structured_output/manager.py)
    parent_request_id: str | None = None  # its parallel-sampling group (n > 1)
    lora_request: object | None = None  # the LoRA adapter it runs under (workers/lora/)
    cache_salt: str | None = None  # salts its prefix-cache keys (block_hash.root_key)


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class Stall:
    """For tests: block the engine-core thread, as a hung step would."""

    seconds: float


EngineCommand = AddRequest | AbortRequest | Stall
