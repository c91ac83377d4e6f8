"""Random add / step / abort sequences keep the block pool consistent."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_in import stand_in_step

from shoal.proto.block_hash import chain_hashes
from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig
from shoal.workers.core.sequence import RequestTimings, Sequence

BS = 4


def check(bm: BlockManager, live: list[Sequence]) -> None:
    pool = bm.pool
    used = [b for b in pool.blocks if b.ref_cnt > 0]
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert len(used) + pool.num_free_blocks == pool.num_blocks
    assert all(pool.blocks[i].ref_cnt == 0 for i in pool.free_queue)
    holders = Counter(b for s in live for b in s.block_table)
    for block_id, n in holders.items():
        assert pool.blocks[block_id].ref_cnt == n
    assert sum(b.ref_cnt for b in pool.blocks) == sum(holders.values())
    # The scheduler's progress stays within the blocks (none once preempted).
    assert all(s.num_computed_tokens <= min(s.num_tokens, len(s.block_table) * BS) for s in live)
    # A block held by two sequences must be the same prefix for both.
    where: dict[int, tuple[Sequence, int]] = {}
    for s in live:
        for i, b in enumerate(s.block_table):
            if b in where:
                other, j = where[b]
                assert i == j and s.token_ids[: (i + 1) * BS] == other.token_ids[: (j + 1) * BS]
            where[b] = (s, i)
    # A registered block is keyed by its holder's chain (the router's keys): what a hit requires.
    for s in live:
        keys = chain_hashes(s.token_ids, BS)
        for i, b in enumerate(s.block_table[: s.num_registered_blocks]):
            assert pool.blocks[b].block_hash == (keys[i] if pool.enable_caching else None)


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(ops=st.lists(op, max_size=60), num_blocks=st.integers(16, 40), budget=st.integers(4, 64), caching=st.booleans())
def test_pool_invariants(ops, num_blocks, budget, caching):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), bm, max_model_len=1 << 20, eos_token_ids=[]
    )
    live: list[Sequence] = []
    n = 0
    shared = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]  # a common prefix for cache hits
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prefix_kind = o
            toks = (shared[:plen] if prefix_kind else []) + [(n * 7 + k) % 50 for k in range(plen)]
            if bm.blocks_needed(len(toks) + max_tokens) > num_blocks:
                continue  # the engine refuses these at submission
            s = Sequence(str(n), toks, len(toks), SamplingParams(max_tokens=max_tokens), n, 0, RequestTimings(0.0))
            n += 1
            sched.add(s)
            live.append(s)
        elif o[0] == "step":
            for s in stand_in_step(sched, budget_check=budget):
                live.remove(s)
        else:
            if live:
                s = live.pop(o[1] % len(live))
                sched.finish(s, "abort")
                assert not s.block_table
        check(bm, live)
    # Drain: every sequence ends and every block is free again.
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        for s in stand_in_step(sched, budget_check=budget):
            live.remove(s)
        check(bm, live)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == num_blocks
