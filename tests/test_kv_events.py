"""KV cache events (--enable-kv-cache-events): each step's blocks stored in
and removed from the paged cache and its tiers, in vLLM's event shapes,
named by the router's chain keys, in a numbered log a subscriber reads from
where it left off (the Serve stream: tests/test_kv_cluster_tier_serve.py)."""

from __future__ import annotations

from test_kv_host_tier import run_together

from shoal.proto.block_hash import chain_hashes
from shoal.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.core.kv_event_log import KVEventLog

BLOCK = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 3 for i in range(n)]


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(model=model, num_kv_blocks=12, num_threads=1, enable_kv_cache_events=True, **kw)


def _run(engine: LLMEngine, prompt: list[int], rid: str) -> list[int]:
    return run_together(engine, {rid: prompt}, PARAMS)[rid]


def _events(engine: LLMEngine, kind=None, medium=None) -> list:
    assert engine.kv_events is not None
    out = [e for b in engine.kv_events.since(0) for e in b.events]
    return [e for e in out if (kind is None or isinstance(e, kind)) and (medium is None or e.medium == medium)]


def test_stored_events_carry_the_routers_keys_the_tokens_and_the_chain(tiny_model):
    engine = _engine(tiny_model)
    try:
        prompt = _prompt(0, 40)
        out = _run(engine, prompt, "a")
        stored = _events(engine, BlockStored, "device")
    finally:
        engine.shutdown()
    tokens = prompt + out
    keys = chain_hashes(tokens, BLOCK)
    # Every full block whose keys and values were computed (the last token's never is), in order.
    n = (len(tokens) - 1) // BLOCK
    assert [h for e in stored for h in e.block_hashes] == keys[:n]
    for e in stored:
        first = keys.index(e.block_hashes[0])
        assert e.parent_block_hash == (keys[first - 1] if first else None)
        assert e.token_ids == tokens[first * BLOCK : (first + len(e.block_hashes)) * BLOCK]
        assert (e.block_size, e.lora_id) == (BLOCK, None)


def test_evictions_are_removed_events_and_the_host_tier_stores_what_the_cache_lost(tiny_model):
    engine = _engine(tiny_model, kv_offload_host_bytes=3 * 2 * 2 * BLOCK * 2 * 16 * 4)  # 3 slots
    try:
        first = _prompt(1, 80)  # 5 full blocks of a 12-block pool: the next prompts evict them
        _run(engine, first, "first")
        for i in range(2, 5):
            _run(engine, _prompt(i, 80), f"p{i}")
        removed = {h for e in _events(engine, BlockRemoved, "device") for h in e.block_hashes}
        host_stored = [h for e in _events(engine, BlockStored, "host") for h in e.block_hashes]
        host_removed = {h for e in _events(engine, BlockRemoved, "host") for h in e.block_hashes}
        held = set(engine.kv_connector.offloaded_hashes(100))
    finally:
        engine.shutdown()
    keys = chain_hashes(first, BLOCK)
    assert set(keys) <= removed  # gone from the paged cache...
    assert set(keys) <= set(host_stored)  # ...each saved to the host tier as it went
    # The tier holds 3: what it stored less what it evicted is what it holds.
    assert set(host_stored) - host_removed == held and len(held) == 3


def test_no_events_unless_asked(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=12, num_threads=1)
    try:
        assert engine.kv_events is None and engine.block_manager.pool.events is None
    finally:
        engine.shutdown()


def test_a_subscriber_reads_from_where_it_left_off_and_one_too_far_behind_starts_over():
    log = KVEventLog(max_batches=2)
    log.append([])  # an empty step is no batch
    assert log.last_seq == 0 and log.since(0) == []
    a, b, c = (BlockRemoved([bytes([i])], "device") for i in range(3))
    log.append([a])
    log.append([b])
    assert [x.events for x in log.since(0)] == [[a], [b]] and [x.seq for x in log.since(1)] == [2]
    log.append([c])  # batch 1 is gone
    behind = log.since(0)
    assert [x.seq for x in behind] == [1, 2, 3]
    assert behind[0].events == [AllBlocksCleared()] and behind[2].events == [c]
    assert log.since(3) == [] and [x.events for x in log.since(2)] == [[c]]


def test_dynamos_block_hash_matches_its_published_test_vector():
    import numpy as np

    from shoal.proto.dynamo_hash import compute_block_hash, local_block_hashes, sequence_hashes

    # lib/kv-router's protocols tests: compute_block_hash(b"test data") is LocalBlockHash(13226331709069118873).
    assert compute_block_hash(b"test data") == 13226331709069118873
    tokens = list(range(40))
    local = local_block_hashes(tokens, 16)  # two full blocks; the 8 tokens past them make none
    assert local == [compute_block_hash(np.arange(i * 16, (i + 1) * 16, dtype="<u4").tobytes()) for i in range(2)]
    seq = sequence_hashes(local)
    assert seq[0] == local[0]
    assert seq[1] == compute_block_hash(np.array([seq[0], local[1]], dtype="<u8").tobytes())
    assert sequence_hashes(local[1:], parent=seq[0]) == seq[1:]  # the chain goes on from where it was


def test_events_can_name_blocks_as_dynamo_does(tiny_model):
    from shoal.proto.dynamo_hash import local_block_hashes, sequence_hashes

    engine = _engine(tiny_model, kv_events_block_hash="dynamo")
    try:
        first = _prompt(1, 80)
        out = _run(engine, first, "first")
        engine.add_request(GenerateRequest("salted", _prompt(9, 40), PARAMS, cache_salt="tenant-a"))
        while "salted" in engine.requests:
            engine.step()
        for i in range(2, 5):  # evict the first prompt's blocks
            _run(engine, _prompt(i, 80), f"p{i}")
        stored = _events(engine, BlockStored, "device")
        removed = [h for e in _events(engine, BlockRemoved, "device") for h in e.block_hashes]
    finally:
        engine.shutdown()
    tokens = first + out
    names = sequence_hashes(local_block_hashes(tokens, BLOCK))[: (len(tokens) - 1) // BLOCK]
    assert len(names) == 5 and stored[0].block_hashes == names  # its prefill stored all 5 at once
    assert stored[0].parent_block_hash is None and stored[0].token_ids == tokens[: 5 * BLOCK]
    assert set(names) <= set(removed)  # the same names when they go
    # A salted request's blocks are not in Dynamo's hash: no event names them.
    assert len(stored) == 1 + 3  # the first prompt's run, and each later prompt's
