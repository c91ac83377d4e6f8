"""The written-down interfaces: every worker pool meets WorkerPool, every
runner meets Runner, every executor meets Executor, every attention backend
meets AttentionBackend, and AsyncEngine's command queue carries dataclasses
that apply as LLMEngine's own calls would."""

from __future__ import annotations

import inspect

import pytest

from shoal.proto.messages import GenerateRequest
from shoal.router.routing.failover import FailoverPool
from shoal.router.routing.pool import WorkerPool
from shoal.router.routing.worker_pool import LocalWorkerPool, ServeWorkerPool
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.async_engine import AsyncEngine
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.engine_commands import AbortRequest, AddRequest
from shoal.workers.llm_engine import LLMEngine
from shoal.workers.model_executor.executor.abstract import Executor, get_executor_class
from shoal.workers.model_executor.executor.ray_executor import RayExecutor
from shoal.workers.model_executor.executor.uniproc_executor import UniProcExecutor
from shoal.workers.model_executor.layers.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
)
from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelBackend
from shoal.workers.model_executor.layers.attention.backends.flash_attn import FlashAttentionBackend
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPABackend
from shoal.workers.model_executor.layers.attention.backends.triton_attn import TritonAttentionBackend
from shoal.workers.model_executor.layers.attention.selector import BACKENDS
from shoal.workers.model_executor.layers.quantization.base_config import LinearMethodBase
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from shoal.workers.model_executor.runner.interface import DeviceRunner, Runner
from shoal.workers.model_executor.runner.model_runner import ModelRunner
from shoal.workers.model_executor.runner.simulated_runner import SimulatedRunner
from shoal.workers.worker import Worker


def _meets(cls, protocol) -> None:
    """`cls` has each of the protocol's methods, of the same kind (plain,
    coroutine, async generator) and with the same parameter names."""
    for name, want in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(want):
            continue
        got = getattr(cls, name)
        if inspect.isasyncgenfunction(got) or inspect.iscoroutinefunction(got):
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), f"{cls.__name__}.{name}"
        elif name == "generate":  # the protocol's generate returns an async iterator: an async generator meets it
            pytest.fail(f"{cls.__name__}.generate is not an async generator")
        else:
            assert not inspect.iscoroutinefunction(want), f"{cls.__name__}.{name} must be async"
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), (
            f"{cls.__name__}.{name}"
        )


@pytest.mark.parametrize("cls", [ServeWorkerPool, LocalWorkerPool, FailoverPool])
def test_every_worker_pool_meets_the_protocol(cls):
    assert issubclass(cls, WorkerPool)
    _meets(cls, WorkerPool)
    assert inspect.isasyncgenfunction(cls.generate)


def test_local_and_failover_pools_are_worker_pools(tiny_model):
    pool = LocalWorkerPool([Worker(EngineArgs(model=tiny_model, num_kv_blocks=16), max_waiting=8)])
    assert isinstance(pool, WorkerPool)
    assert isinstance(FailoverPool(pool), WorkerPool)
    assert not isinstance(object(), WorkerPool)


@pytest.mark.parametrize("cls,protocol", [(ModelRunner, DeviceRunner), (SimulatedRunner, Runner)])
def test_every_runner_meets_the_protocol(cls, protocol):
    _meets(cls, protocol)


def test_the_unquantized_linear_method_meets_linear_method_base():
    assert issubclass(UnquantizedLinearMethod, LinearMethodBase)
    _meets(UnquantizedLinearMethod, LinearMethodBase)
    UnquantizedLinearMethod()  # an ABC: builds only with every abstract method given


@pytest.mark.parametrize("load_format,protocol", [("auto", DeviceRunner), ("simulated", Runner)])
def test_the_engines_runner_is_a_runner(tiny_model, load_format, protocol):
    engine = LLMEngine(EngineArgs(model=tiny_model, load_format=load_format, num_kv_blocks=16))
    assert isinstance(engine.runner, protocol)


@pytest.mark.parametrize("cls", [UniProcExecutor, RayExecutor])
def test_every_executor_meets_the_protocol(cls):
    _meets(cls, Executor)


def test_the_engine_gets_the_executor_its_size_needs(tiny_model):
    assert get_executor_class(EngineArgs(tensor_parallel_size=2)) is RayExecutor
    engine = LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=16))
    assert isinstance(engine.model_executor, UniProcExecutor) and isinstance(engine.model_executor, Executor)
    assert engine.runner is engine.model_executor.driver_worker.runner


@pytest.mark.parametrize("cls", [TorchSDPABackend, CPUKernelBackend, TritonAttentionBackend, FlashAttentionBackend])
def test_every_attention_backend_meets_the_protocol(cls):
    """Built without a device: validate, not the constructor, checks where a backend runs."""
    backend = cls()
    _meets(cls, AttentionBackend)
    assert isinstance(backend, AttentionBackend)
    assert BACKENDS[backend.name] is cls  # the selector knows it by its own name
    _meets(backend.builder_cls, AttentionMetadataBuilder)
    _meets(backend.impl_cls, AttentionImpl)
    assert not isinstance(object(), AttentionBackend)


def test_queued_commands_apply_in_order(tiny_model):
    """Nothing steps here: the engine-core thread is never started, so the
    queue is applied by hand, as that thread would between two steps."""
    aeng = AsyncEngine(LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=16)))
    ids = aeng.engine.tokenize("Hello there")
    aeng._submit(AddRequest(GenerateRequest("a", ids, SamplingParams(max_tokens=4))))
    aeng._submit(AddRequest(GenerateRequest("b", ids, SamplingParams(max_tokens=4), priority=1, num_resumed_tokens=2)))
    assert aeng.num_waiting == 2  # queued adds count before they reach the scheduler
    aeng._submit(AbortRequest("a"))
    aeng._submit(AddRequest(GenerateRequest("b", ids, SamplingParams())))  # a second "b": fails alone
    aeng._submit(AbortRequest("never-added"))  # nothing to stop, nothing delivered
    delivered = aeng._apply_pending()
    assert not aeng._pending
    assert [rid for rid, _ in delivered] == ["a", "b"]
    aborted, failed = delivered[0][1], delivered[1][1]
    assert isinstance(aborted, RequestOutput) and aborted.finish_reason == "abort"
    assert isinstance(failed, Exception)
    assert list(aeng.engine.requests) == ["b"]
    seq = aeng.engine.requests["b"].seq
    assert (seq.priority, seq.output_token_ids) == (1, ids[-2:])  # the resumed tokens count as output
    assert aeng.num_waiting == 1
