"""`shoal bench serve` reports the engine process's CPU use beside its figures."""

from __future__ import annotations

import os

from shoal.benchmarks.serve import Result, print_table, summarize


def test_the_worker_cpu_use_is_printed_per_target(capsys):
    res = [Result(ok=True, ttft=0.1, e2e=1.0, output_tokens=10, prompt_tokens=5) for _ in range(4)]
    local = summarize("in-process", res, 2.0, {"this process": 3.0, "Worker": 0.01})
    served = summarize("cluster HTTP", res, 4.0, {"this process": 1.0, "Router": 2.0, "Worker": 6.0})
    assert local["cpu_percent"]["this process"] == 150.0 and served["cpu_percent"]["Worker"] == 150.0
    print_table([local, served])
    lines = {line[:32].strip(): line[32:].split() for line in capsys.readouterr().out.splitlines()}
    # In-process the engine is this process; served, the Worker replica's.
    assert lines["worker CPU (% of one core)"] == ["150", "150"]
    cores = len(os.sched_getaffinity(0))
    assert lines[f"worker CPU (% of {cores} cores)"] == [f"{150 / cores:.0f}"] * 2
