"""The model runner's persistent block tables (runner/input_batch.py) and
the flat batch staged from them, against the same computed per row and
per token in plain Python, over random steps: tables that grow, freed
sequences that get new lists, rows reclaimed and arrays grown."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.proto.sampling_params import SamplingParams
from shoal.proto.utils import cdiv
from shoal.workers.core.sequence import PLACEHOLDER_TOKEN_ID, RequestTimings, Sequence
from shoal.workers.model_executor.runner.input_batch import InputBatch
from shoal.workers.model_executor.runner.model_runner import ModelRunner

BS = 4


def _reference_slots(tables: list[list[int]], rows: list[int], positions: list[int]) -> list[int]:
    return [tables[r][p // BS] * BS + p % BS for r, p in zip(rows, positions)]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rows_mirror_tables_through_growth_frees_and_reclaims(data):
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    batch = InputBatch(max_blocks_per_seq=2, capacity=2)  # small: reclaiming and growing both happen
    tables: list[list[int]] = [[] for _ in range(6)]
    for _ in range(data.draw(st.integers(1, 25))):
        for i in range(len(tables)):
            roll = rng.random()
            if roll < 0.1:
                tables[i] = []  # freed: a new list (BlockManager.free)
            elif roll < 0.6:
                tables[i].extend(rng.randrange(1000) for _ in range(rng.randrange(3)))
        step = [t for t in tables if t and rng.random() < 0.7]
        if not step:
            continue
        rows = batch.rows_for(step)
        assert len(set(rows.tolist())) == len(step)
        width = max(map(len, step)) + rng.randrange(2)
        got = batch.gather(rows, width)
        for t, g in zip(step, got.tolist()):
            assert g == (t + [0] * width)[:width]
        positions = [rng.randrange(len(t) * BS) for t in step]
        slots = batch.slots(rows, np.asarray(positions), BS)
        assert slots.tolist() == _reference_slots(step, list(range(len(step))), positions)
        assert batch.num_rows <= max(2, 2 * len(tables))


def test_a_position_past_its_blocks_is_an_error_not_a_stale_slot():
    batch = InputBatch(max_blocks_per_seq=4)
    rows = batch.rows_for([[7, 8]])
    assert batch.slots(rows, np.array([7]), BS).tolist() == [8 * BS + 3]
    with pytest.raises(IndexError, match="position 8"):
        batch.slots(rows, np.array([8]), BS)


def test_a_freed_sequences_row_is_reclaimed_not_kept():
    batch = InputBatch(max_blocks_per_seq=4, capacity=2)
    old = [[1], [2]]
    batch.rows_for(old)
    new = [[3], [4]]
    rows = batch.rows_for(new)  # the old lists are not in this step: their rows are reused
    assert batch.num_rows == 2 and batch.gather(rows, 1).tolist() == [[3], [4]]
    rows = batch.rows_for(new + [[5]])  # all in the step: the array grows
    assert batch.num_rows == 3 and batch.gather(rows, 1).tolist() == [[3], [4], [5]]


def _seq(i: int, num_tokens: int, computed: int, lora_slot: int | None = None) -> Sequence:
    s = Sequence(f"r{i}", [100 * i + j for j in range(num_tokens)], 1, SamplingParams(), i, 0, RequestTimings(0.0))
    s.num_computed_tokens = computed
    s.block_table = [1000 * i + b for b in range(cdiv(num_tokens, BS))]
    s.lora_slot = lora_slot
    return s


def _runner(lora: bool) -> ModelRunner:
    """Only what _flat_batch reads of a runner."""
    runner = object.__new__(ModelRunner)
    runner.block_size = BS
    runner.input_batch = InputBatch(8)
    runner.lora_manager = object() if lora else None
    return runner


@pytest.mark.parametrize("lora", [False, True])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_flat_batch_matches_rows_in_python(lora, data):
    """Order (decodes first, longest context first, then adapters grouped),
    token ids, positions, slots, logits rows and due rows, as the runner
    made them one row at a time before the persistent batch."""
    runner = _runner(lora)
    for _ in range(3):  # the same runner over steps: rows persist
        scheduled = []
        for i in range(data.draw(st.integers(1, 12))):
            total = data.draw(st.integers(1, 40))
            n = data.draw(st.integers(1, total))
            computed = total - n if data.draw(st.booleans()) else max(0, total - n - data.draw(st.integers(0, 3)))
            n = min(n, total - computed)
            slot = data.draw(st.sampled_from([None, 0, 1])) if lora else None
            scheduled.append((_seq(i, total, computed, slot), n))
        step = runner._flat_batch(scheduled)

        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda r: -r[0].num_computed_tokens)
        rows = decodes + [(s, n) for s, n in scheduled if n > 1]
        if lora:
            rows.sort(key=lambda r: (r[1] > 1) * (1 << 20) + (-1 if r[0].lora_slot is None else r[0].lora_slot))
        ids, positions, slots, logits = [], [], [], []
        for s, n in rows:
            start = s.num_computed_tokens
            for p in range(start, start + n):
                ids.append(s.token_ids[p])
                positions.append(p)
                slots.append(s.block_table[p // BS] * BS + p % BS)
            if start + n == len(s.token_ids):
                logits.append(len(ids) - 1)
        assert [s.request_id for s in step.seqs] == [s.request_id for s, _ in rows]
        assert step.num_decodes == len(decodes)
        assert step.input_ids.tolist() == ids
        assert step.positions.tolist() == positions
        assert step.slots.tolist() == slots
        assert step.logits_indices.tolist() == logits
        assert step.due_mask == [s.num_computed_tokens + n == len(s.token_ids) for s, n in rows]
        if lora:
            want = [(-1 if s.lora_slot is None else s.lora_slot) for s, n in rows for _ in range(n)]
            assert ModelRunner._lora_token_slots(step).tolist() == want


def test_placeholders_are_found_and_a_misplaced_one_is_refused():
    runner = _runner(lora=False)
    a, b = _seq(0, 9, 8), _seq(1, 6, 5)
    a.token_ids[-1], a.num_output_placeholders = PLACEHOLDER_TOKEN_ID, 1
    step = runner._flat_batch([(b, 1), (a, 1)])  # a has the longer context: first
    assert ModelRunner._placeholders(step) == ([0], [a])
    c = _seq(2, 9, 4)
    c.token_ids[6], c.num_output_placeholders = PLACEHOLDER_TOKEN_ID, 1  # not its last token
    with pytest.raises(RuntimeError, match="request r2: a step may read one placeholder"):
        ModelRunner._placeholders(runner._flat_batch([(c, 5)]))
