"""Where a tensor-parallel replica's ranks go: no torch here, since the
cluster's options read it when they build the Serve application."""

from __future__ import annotations


def tp_bundles(tp_size: int, gpu: bool, cpus: float = 1.0) -> list[dict]:
    """One bundle per rank. On GPUs the other ranks take no CPU, so they
    schedule wherever the GPUs are (Ray: an actor in a GPU bundle needs
    num_cpus=0 or a CPU in the bundle)."""
    if gpu:
        return [{"CPU": cpus, "GPU": 1}] + [{"GPU": 1}] * (tp_size - 1)
    return [{"CPU": cpus}] * tp_size
