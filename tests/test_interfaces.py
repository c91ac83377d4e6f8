"""The written-down interfaces: every worker pool meets WorkerPool, every
runner meets Runner, and AsyncEngine's command queue carries dataclasses
that apply as LLMEngine's own calls would."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from shoal.router.failover import FailoverPool
from shoal.router.pool import WorkerPool
from shoal.router.worker_pool import LocalWorkerPool, ServeWorkerPool
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.async_engine import AsyncEngine
from shoal.workers.core.outputs import RequestOutput
from shoal.workers.engine_commands import AbortRequest, AddRequest
from shoal.workers.llm_engine import LLMEngine
from shoal.workers.model_executor.model_runner import ModelRunner
from shoal.workers.model_executor.runner import DeviceRunner, Runner
from shoal.workers.model_executor.simulated_runner import SimulatedRunner
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


@pytest.mark.parametrize("load_format,protocol", [("auto", DeviceRunner), ("simulated", Runner)])
def test_the_engines_runner_is_a_runner(tiny_model, load_format, protocol):
    engine = LLMEngine(EngineArgs(model=tiny_model, load_format=load_format, num_kv_blocks=16))
    assert isinstance(engine.runner, protocol)


def test_add_request_carries_llm_engine_add_requests_arguments():
    """Every argument of LLMEngine.add_request but the arrival time (set when
    the thread applies it), in its order; the prompt comes tokenized."""
    params = [p for p in inspect.signature(LLMEngine.add_request).parameters if p not in ("self", "arrival_time")]
    fields = [f.name for f in dataclasses.fields(AddRequest)]
    assert fields == ["prompt_ids" if p == "prompt" else p for p in params]


def test_queued_commands_apply_in_order(tiny_model):
    """Nothing steps here: the engine-core thread is never started, so the
    queue is applied by hand, as that thread would between two steps."""
    aeng = AsyncEngine(LLMEngine(EngineArgs(model=tiny_model, num_kv_blocks=16)))
    ids = aeng.engine.tokenize("Hello there")
    aeng._submit(AddRequest("a", ids, SamplingParams(max_tokens=4)))
    aeng._submit(AddRequest("b", ids, SamplingParams(max_tokens=4), priority=1, num_resumed_tokens=2))
    assert aeng.num_waiting == 2  # queued adds count before they reach the scheduler
    aeng._submit(AbortRequest("a"))
    aeng._submit(AddRequest("b", ids, SamplingParams()))  # a second "b": fails alone
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
