"""The engine: continuous batching over a paged KV cache."""

from shoal.workers.async_engine import AsyncEngine
from shoal.workers.engine_args import EngineArgs
from shoal.workers.errors import InvalidRequestError
from shoal.workers.llm import LLM
from shoal.workers.llm_engine import EngineStats, LLMEngine
from shoal.workers.core.outputs import CompletionOutput, RequestOutput
from shoal.workers.core.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "CompletionOutput", "EngineArgs", "EngineStats", "InvalidRequestError", "LLM",
           "LLMEngine", "RequestOutput", "SamplingParams"]  # fmt: skip
