"""The engine's named step ranges (workers/profiling.py): off, nothing is
recorded; on, every part of a step is timed and shows in torch.profiler."""

from __future__ import annotations

import torch

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams, profiling

ENGINE_RANGES = {"schedule", "execute_model", "update_from_output", "detokenize", "prepare_inputs", "forward", "sample"}


def _run(engine: LLMEngine, rid: str) -> None:
    engine.add_request(
        GenerateRequest(rid, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    )
    while engine.has_unfinished_requests():
        engine.step()


def test_ranges_are_off_unless_enabled_and_then_time_every_part_of_a_step(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=16, num_threads=1)
    _run(engine, "off")
    assert profiling.seconds() == {}
    profiling.enable()
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(engine, "on")
        seen = profiling.seconds()
    finally:
        profiling.enable(False)
    assert ENGINE_RANGES <= set(seen) <= set(profiling.RANGES) and all(s > 0 for s in seen.values())
    # The runner's parts nest inside the executor's call.
    assert seen["prepare_inputs"] + seen["forward"] + seen["sample"] <= seen["execute_model"]
    names = {e.key for e in prof.key_averages()}
    assert ENGINE_RANGES <= names
    assert profiling.seconds() == {}  # off again, and zeroed
