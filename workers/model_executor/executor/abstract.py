"""What LLMEngine calls on its executor (vLLM v1's executor/abstract.py),
and which executor an engine gets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from shoal.workers.engine_args import EngineArgs
    from shoal.workers.model_executor.runner.rank_worker import RankWorker


@runtime_checkable
class Executor(Protocol):
    """Every rank of one worker replica, driven as one. Built as
    cls(args, loaded, max_model_len): each rank's device is up and its model
    loaded; a constructor that fails leaves nothing running."""

    driver_worker: RankWorker  # rank 0, in this process: its runner, device and CUDA graphs

    def determine_num_available_blocks(self) -> int:
        """KV blocks every rank's budget holds (the least of them)."""
        ...

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate every rank's KV cache and warm up; the first step may follow."""
        ...

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step on every rank; rank 0's sampled tokens."""
        ...

    def check_health(self) -> None:
        """Raise if a rank is gone."""
        ...

    def shutdown(self) -> None:
        """Stop every other rank and free what they held (safe to call twice)."""
        ...


def get_executor_class(args: EngineArgs) -> type[Executor]:
    if args.tensor_parallel_size > 1:
        from shoal.workers.model_executor.executor.ray_executor import RayExecutor

        return RayExecutor
    from shoal.workers.model_executor.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor
