"""Tensor parallelism across processes: where the ranks go (placement.py)
and the compact per-step inputs rank 0 broadcasts to the others
(step_input.py); the ranks themselves are model_executor's RankWorker."""
