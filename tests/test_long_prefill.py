"""Prefill under a queue of prompts: long_prefill_token_threshold caps a
prompt's chunk, max_num_partial_prefills / max_long_partial_prefills bound
the prompts left part-prefilled, and running decodes are never starved."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_in import stand_in_step

from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig
from shoal.workers.core.sequence import RequestTimings, Sequence

BS = 4


def _sched(budget: int, threshold: int = 0, partial: int = 1, long: int = 1, blocks: int = 512) -> Scheduler:
    bm = BlockManager(blocks, BS, enable_prefix_caching=False)
    config = SchedulerConfig(budget, 16, threshold, partial, long)
    return Scheduler(config, bm, max_model_len=1 << 16, eos_token_ids=[])


def _add(sched: Scheduler, rid: str, n: int, max_tokens: int = 50, order: int = 0) -> Sequence:
    toks = [(order * 7 + k) % 50 for k in range(n)]
    seq = Sequence(rid, toks, n, SamplingParams(max_tokens=max_tokens), order, 0, RequestTimings(0.0))
    sched.add(seq)
    return seq


def _step(sched: Scheduler) -> dict[str, int]:
    """One step with made-up tokens; returns {request id: tokens computed}."""
    out = sched.schedule()
    seqs = out.seqs_due_token
    sched.update_from_output(out, ModelRunnerOutput(seqs, [1] * len(seqs), [None] * len(seqs)))
    return {s.request_id: n for s, n in out.scheduled}


def test_a_queue_of_long_prompts_never_starves_running_decodes():
    sched = _sched(budget=64, threshold=16)
    decodes = [_add(sched, f"d{k}", 4, order=k) for k in range(3)]
    _step(sched)  # their prompts
    for k in range(5):
        _add(sched, f"long{k}", 200, order=10 + k)
    for _ in range(20):
        step = _step(sched)
        assert all(step[d.request_id] == 1 for d in decodes)  # every running decode, every step
        assert all(n <= 16 for n in step.values())  # no chunk past the threshold
        assert sum(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running) <= 1  # one partial prefill
    # Off (the default): the first long prompt takes what the decodes leave.
    sched = _sched(budget=64)
    decodes = [_add(sched, f"d{k}", 4, order=k) for k in range(3)]
    _step(sched)
    _add(sched, "long", 200, order=10)
    assert _step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 61}


def test_several_partial_prefills_share_a_step_as_configured():
    sched = _sched(budget=64, threshold=16, partial=3, long=2)
    for k in range(4):
        _add(sched, f"long{k}", 100, order=k)
    # Two long prompts at once (max_long_partial_prefills), 16 tokens each.
    assert _step(sched) == {"long0": 16, "long1": 16}
    assert _step(sched) == {"long0": 16, "long1": 16}
    # A short prompt goes ahead of the long ones waiting beyond the limit.
    _add(sched, "short", 10, order=9)
    assert _step(sched) == {"long0": 16, "long1": 16, "short": 10}
    # One long prompt at a time: the second (and mid, over the threshold too) wait; a short one goes.
    sched = _sched(budget=40, threshold=16, partial=2, long=1)
    _add(sched, "long", 100, order=0)
    _add(sched, "long-b", 100, order=1)
    _add(sched, "mid", 16 + 8, order=2)  # over the threshold: long too
    _add(sched, "short", 12, order=3)
    assert _step(sched) == {"long": 16, "short": 12}
    # short is decoding now; mid and long-b still wait behind the one long prompt allowed.
    assert _step(sched) == {"short": 1, "long": 16}


def test_the_partial_prefill_limit_holds_back_a_prompt_the_budget_would_split():
    sched = _sched(budget=40, threshold=32, partial=1, long=1)
    _add(sched, "a", 100, order=0)  # long: 32 a step, left partial
    _add(sched, "b", 20, order=1)  # would be split by the 8 tokens left: a second partial prefill
    _add(sched, "c", 6, order=2)  # fits whole
    assert _step(sched) == {"a": 32, "c": 6}


@pytest.mark.parametrize("bad", [dict(long_prefill_token_threshold=-1), dict(max_num_partial_prefills=0)])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(64, 8, **bad)
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(64, 8, 0, 2, 3)


def test_several_partial_prefills_default_the_threshold_to_4_percent_of_the_model_length():
    bm = BlockManager(64, BS, enable_prefix_caching=False)
    assert Scheduler(SchedulerConfig(64, 8, 0, 2, 1), bm, 1000, []).long_prefill_threshold == 40
    assert Scheduler(SchedulerConfig(64, 8), bm, 1000, []).long_prefill_threshold == 0


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(
    max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    ops=st.lists(op, max_size=50),
    budget=st.integers(4, 64),
    threshold=st.integers(0, 40),
    partial=st.integers(1, 3),
    long=st.integers(1, 3),
    blocks=st.integers(40, 80),
)
def test_every_request_finishes_under_any_limits(ops, budget, threshold, partial, long, blocks):
    """Random adds, steps and aborts under a small cache (preemptions): the
    limits hold in every step and nothing waits forever."""
    long = min(long, partial)
    sched = _sched(budget, threshold, partial, long, blocks)
    thr = sched.long_prefill_threshold
    live, n = [], 0

    def step():
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        split = [(s, k) for s, k in out.scheduled if k < s.num_tokens - s.num_computed_tokens]
        if thr:
            assert all(k <= thr for s, k in out.scheduled)
            # New prompts respect both limits; one already running goes on whatever they say.
            new = [s for s, _ in split if s.num_computed_tokens == 0]
            assert len(new) <= partial
        seqs = out.seqs_due_token
        for s in sched.update_from_output(out, ModelRunnerOutput(seqs, [1] * len(seqs), [None] * len(seqs))):
            live.remove(s)

    for o in ops:
        if o[0] == "add":
            if sched.block_manager.blocks_needed(o[1] + o[2]) > blocks:
                continue
            live.append(_add(sched, str(n), o[1], o[2], order=n))
            n += 1
        elif o[0] == "step":
            step()
        elif live:
            sched.finish(live.pop(o[1] % len(live)), "abort")
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished() and not live
    assert sched.block_manager.num_free_blocks == blocks
    assert stand_in_step(sched) == []
