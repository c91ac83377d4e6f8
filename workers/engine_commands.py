"""What AsyncEngine's callers queue for the engine-core thread, which applies
them between steps (vLLM v1's EngineCoreRequest and its abort and utility calls)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.proto.messages import GenerateRequest


@dataclass(slots=True)
class AddRequest:
    """LLMEngine.add_request's arguments: the request as it came, checked already."""

    request: GenerateRequest
    grammar: object | None = None  # params.structured_outputs, compiled (structured_output/manager.py)


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class Stall:
    """For tests: block the engine-core thread, as a hung step would."""

    seconds: float


EngineCommand = AddRequest | AbortRequest | Stall
