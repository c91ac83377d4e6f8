"""The engine: continuous batching over a paged KV cache.

Its names load on first use (PEP 562), so that a process that needs only
the light parts (the router: errors, sampling parameters, request checks,
wire messages) never imports torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AsyncEngine": "shoal.workers.async_engine",
    "CompletionOutput": "shoal.workers.core.outputs",
    "EngineArgs": "shoal.workers.engine_args",
    "EngineStats": "shoal.proto.stats",
    "InvalidRequestError": "shoal.proto.errors",
    "LLM": "shoal.workers.llm",
    "LLMEngine": "shoal.workers.llm_engine",
    "RequestOutput": "shoal.workers.core.outputs",
    "SamplingParams": "shoal.proto.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
