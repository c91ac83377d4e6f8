"""What LLMEngine needs of its model runner: ModelRunner runs the model,
SimulatedRunner stands in for it with a cost model's step time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from shoal.workers.model_executor.runner.cuda_graph import CaptureStats


@runtime_checkable
class Runner(Protocol):
    """Every runner: a KV cache of the engine's size, and one step."""

    @property
    def varlen(self) -> bool:
        """Whether the step's attention is one varlen kernel call per layer (what CUDA graphs replay)."""
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def release_kv_cache(self) -> None: ...

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and sample its tokens."""
        ...


@runtime_checkable
class PreparingRunner(Runner, Protocol):
    """A runner that stages a step apart from computing it: prepare reads the
    sequences, run_prepared touches none of them, so the engine may schedule
    the next step meanwhile (async scheduling, workers/step_pipeline.py)."""

    def prepare(self, sched: SchedulerOutput) -> Any: ...

    def run_prepared(self, prep: Any, previous: ModelRunnerOutput | None = None) -> ModelRunnerOutput:
        """Compute and sample; previous: the step before's output, whose tokens fill prep's placeholders."""
        ...


@runtime_checkable
class DeviceRunner(Runner, Protocol):
    """A runner on a real device, which the engine also sizes the KV cache
    with (a profiling forward) and captures CUDA graphs from; only on CUDA."""

    def profile_num_blocks(self, num_tokens: int) -> int: ...

    def profile_run(self, num_tokens: int, num_seqs: int) -> None: ...

    def capture_cudagraphs(self) -> CaptureStats: ...
