"""The cluster KV tier (workers/kv_transfer/cluster_tier.py) between two
engines of one process, as two workers share it: a conversation whose turns
alternate between them gets each earlier turn's blocks from the other
engine, asynchronously (the request waits, the others' steps go on), with
the tokens a single engine without tiers gives. A block evicted while it
loads, damaged, or lost with its source is computed instead."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_kv_host_tier import BLOCK, GREEDY, POOL_BLOCKS, SEEDED, SHARED, _prompt, _run, run_together

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.core.sequence import SequenceStatus
from shoal.workers.kv_transfer import cluster_tier
from shoal.workers.kv_transfer.cluster_store import KVClusterStore, StoredBlock

TURN_1 = SHARED + _prompt(1, 20)  # 116 tokens: 7 full blocks once its 8 outputs are appended
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}


def _turn_2(out_1: list[int]) -> list[int]:
    return TURN_1 + out_1 + _prompt(2, 30)


@pytest.fixture(autouse=True)
def fresh_store():
    cluster_tier.reset_process_store()
    yield
    cluster_tier.reset_process_store()


def _engine(model: str, **kw) -> LLMEngine:
    kw.setdefault("kv_cluster_tier", "object-store")
    return LLMEngine(model=model, num_kv_blocks=POOL_BLOCKS, num_threads=1, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Both turns on one engine without tiers (the second turn hits the first's blocks in its own pool)."""
    engine = LLMEngine(model=tiny_model, num_kv_blocks=POOL_BLOCKS, num_threads=1)
    try:
        out = {}
        for name, params in PARAMS.items():
            (out_1,) = _run(engine, [TURN_1], params)
            (out_2,) = _run(engine, [_turn_2(out_1)], params)
            out[name] = (out_1, out_2)
        return out
    finally:
        engine.shutdown()


def _two_turns(model: str, params: SamplingParams, **kw) -> tuple[list[int], list[int], dict]:
    """Turn 1 on engine A, turn 2 on engine B: B's tier counters."""
    a, b = _engine(model, **kw), _engine(model, **kw)
    try:
        (out_1,) = _run(a, [TURN_1], params)
        a.shutdown()  # every publish made, and its source gone: the blocks outlive it
        (out_2,) = _run(b, [_turn_2(out_1)], params)
        return out_1, out_2, b.kv_tier_stats()
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_turn_on_another_engine_loads_the_first_turns_blocks(tiny_model, reference, kind):
    out_1, out_2, tiers = _two_turns(tiny_model, PARAMS[kind])
    assert (out_1, out_2) == reference[kind]
    # Turn 1's prompt and all outputs but the last (whose keys and values no step computed): 123 tokens.
    computed = len(TURN_1) + len(out_1) - 1
    assert tiers["cluster"].hit_tokens == computed // BLOCK * BLOCK
    assert tiers["cluster"].loaded_blocks == computed // BLOCK and tiers["cluster"].failed_blocks == 0
    # The store holds what either engine published: turn 1's blocks and turn 2's new ones.
    assert tiers["cluster"].used_blocks >= computed // BLOCK
    # The fetch was timed, from its start to its blocks' arrival: one load.
    assert tiers["cluster"].load_us > 0 and sum(tiers["cluster"].load_buckets) == 1


def test_blocks_stored_in_fp8_cross_engines_too(tiny_model):
    """--kv-offload-dtype fp8: a quarter of the bytes in the store, loaded back (rounded) all the same."""
    out_1, _, tiers = _two_turns(tiny_model, GREEDY, kv_offload_dtype="fp8")
    computed = len(TURN_1) + len(out_1) - 1
    assert tiers["cluster"].hit_tokens == computed // BLOCK * BLOCK and tiers["cluster"].failed_blocks == 0
    assert tiers["cluster"].bytes_per_block * 4 == 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny model's float32 block


def test_the_blocks_of_a_chunked_prefill_are_published_too(tiny_model, reference):
    """Steps that only prefill a chunk sample nothing: their blocks are published all the same."""
    out_1, out_2, tiers = _two_turns(tiny_model, GREEDY, max_num_batched_tokens=32)
    assert (out_1, out_2) == reference["greedy"]
    assert tiers["cluster"].hit_tokens == (len(TURN_1) + len(out_1) - 1) // BLOCK * BLOCK


def test_two_requests_fetching_the_same_blocks_at_once_both_land(tiny_model, reference):
    """Concurrent loads of one block from the cluster: each request waits
    for its own fetch into its own blocks; both give the reference tokens."""
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        (out_1,) = _run(a, [TURN_1], GREEDY)
        a.shutdown()
        prompt = _turn_2(out_1)
        outs = run_together(b, {"twin-a": prompt, "twin-b": prompt}, GREEDY)
        cluster = b.kv_tier_stats()["cluster"]
    finally:
        a.shutdown()
        b.shutdown()
    assert outs["twin-a"] == outs["twin-b"] == reference["greedy"][1]
    computed = len(TURN_1) + len(out_1) - 1
    assert cluster.failed_blocks == 0 and cluster.hit_tokens >= computed // BLOCK * BLOCK


def test_two_salts_never_share_a_cluster_block(tiny_model):
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        _run(a, [TURN_1], GREEDY, salt="tenant-a")
        _run(b, [TURN_1], GREEDY, salt="tenant-b")
        assert b.kv_tier_stats()["cluster"].hit_tokens == 0
        _run(b, [TURN_1], GREEDY, salt="tenant-a")  # b's pool has tenant-b's only
        assert b.kv_tier_stats()["cluster"].hit_tokens == (len(TURN_1) - 1) // BLOCK * BLOCK
    finally:
        a.shutdown()
        b.shutdown()


def _damage(kind: str):
    """A fetch of the store's blocks that finds them evicted meanwhile, or damaged."""
    store = cluster_tier.process_store(1)
    real_get = store.get

    def get(keys):
        if kind == "evicted":
            store.discard(keys[-1:])  # the last block goes between the lookup and the fetch
            return real_get(keys)
        blocks = real_get(keys)
        bad = blocks[0].payload.copy()
        bad[100] ^= 0x10
        return [StoredBlock(bad, blocks[0].crc32, blocks[0].nbytes), *blocks[1:]]

    store.get = get


@pytest.mark.parametrize("kind", ["evicted", "damaged"])
def test_a_block_evicted_while_loading_or_damaged_is_computed_instead(tiny_model, reference, kind):
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        (out_1,) = _run(a, [TURN_1], GREEDY)
        a.shutdown()
        _damage(kind)
        (out_2,) = _run(b, [_turn_2(out_1)], GREEDY)
        tiers = b.kv_tier_stats()
    finally:
        a.shutdown()
        b.shutdown()
    assert (out_1, out_2) == reference["greedy"]
    assert tiers["cluster"].failed_blocks == tiers["cluster"].loaded_blocks > 0


class HeldFetch:
    """Holds every cluster fetch of this process until released."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started = threading.Event()

        def fetch(client, keys):
            def held():
                self.started.set()
                self.release.wait(60)
                return [cluster_tier._checked(b, None if b is None else b.payload) for b in client.store.get(keys)]

            return client._pool.submit(held)

        monkeypatch.setattr(cluster_tier.LocalClusterClient, "fetch", fetch)


def test_a_loading_request_holds_no_step_and_lands_with_the_same_tokens(tiny_model, reference, monkeypatch):
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        (out_1,) = _run(a, [TURN_1], GREEDY)
        held = HeldFetch(monkeypatch)
        b.add_request(GenerateRequest("loading", _turn_2(out_1), GREEDY))
        b.add_request(GenerateRequest("other", _prompt(9, 40), GREEDY))
        tokens: dict[str, list[int]] = {"loading": [], "other": []}
        seq = b.requests["loading"].seq
        while len(tokens["other"]) < GREEDY.max_tokens:  # "other" runs to its end while "loading" waits
            for d in b.step():
                tokens[d.request_id] += d.new_token_ids
        assert held.started.is_set() and seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
        assert tokens["loading"] == [] and b.scheduler.num_waiting == 1
        held.release.set()
        while b.has_unfinished_requests():
            for d in b.step():
                tokens[d.request_id] += d.new_token_ids
        assert tokens["loading"] == reference["greedy"][1]
        assert b.kv_tier_stats()["cluster"].loaded_blocks > 0
    finally:
        held.release.set()
        a.shutdown()
        b.shutdown()


def test_an_abort_while_loading_frees_the_blocks_once_the_load_is_done(tiny_model, monkeypatch):
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        (out_1,) = _run(a, [TURN_1], GREEDY)
        held = HeldFetch(monkeypatch)
        pool = b.block_manager.pool
        free_before = pool.num_free_blocks
        b.add_request(GenerateRequest("loading", _turn_2(out_1), GREEDY))
        b.step()
        held.started.wait(60)
        assert pool.num_free_blocks < free_before  # the loading request holds its blocks
        b.abort_request("loading")
        assert pool.num_free_blocks < free_before  # still being written: not handed out yet
        held.release.set()
        while b.scheduler.loading:
            b.step()
        assert pool.num_free_blocks == free_before and not b.has_unfinished_requests()
    finally:
        held.release.set()
        a.shutdown()
        b.shutdown()


def test_a_fetch_that_raises_is_computed_instead(tiny_model, reference, monkeypatch):
    a, b = _engine(tiny_model), _engine(tiny_model)
    try:
        (out_1,) = _run(a, [TURN_1], GREEDY)

        def gone():
            raise ConnectionError("the source node is gone (test)")

        monkeypatch.setattr(cluster_tier.LocalClusterClient, "fetch", lambda client, keys: client._pool.submit(gone))
        (out_2,) = _run(b, [_turn_2(out_1)], GREEDY)
        assert out_2 == reference["greedy"][1]
        assert b.kv_tier_stats()["cluster"].failed_blocks > 0
    finally:
        a.shutdown()
        b.shutdown()


def test_store_evicts_least_recently_used_blocks_past_its_bytes():
    store = KVClusterStore(capacity_bytes=300)

    def block(n: int) -> StoredBlock:
        return StoredBlock(np.zeros(n, np.uint8), 0, n)

    assert store.put([b"a", b"b"], [block(100), block(100)]) == 2
    assert store.contains([b"a"]) == [True]  # a is now the most recent
    store.put([b"c", b"d"], [block(100), block(100)])
    assert store.contains([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    assert store.put([b"huge"], [block(301)]) == 0 and store.get([b"huge"]) == [None]
    stats = store.stats()
    assert stats["used_bytes"] == 300 and stats["evicted_blocks"] == 1
    store.discard([b"c"])
    assert store.stats()["used_bytes"] == 200
