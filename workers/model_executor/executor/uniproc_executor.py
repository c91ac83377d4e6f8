"""tensor_parallel_size 1: the one rank in this process, called directly."""

from __future__ import annotations

from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.loader.model_loader import LoadedModel
from shoal.workers.model_executor.runner.rank_worker import RankWorker


class UniProcExecutor:
    def __init__(self, args: EngineArgs, loaded: LoadedModel, max_model_len: int):
        self.driver_worker = RankWorker(args)
        self.driver_worker.init_device()
        self.driver_worker.load_model(max_model_len, loaded)

    def determine_num_available_blocks(self) -> int:
        return self.driver_worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.driver_worker.init_cache(num_blocks)
        self.driver_worker.warm_up()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched)

    def check_health(self) -> None:
        """Nothing to check: the one rank is this process."""

    def shutdown(self) -> None:
        """Nothing to stop."""
