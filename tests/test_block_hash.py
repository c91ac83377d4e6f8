"""Prefix-cache keys: SHA-256 chains, equal in the router and the engine,
computed once, and a hit only on a whole matching chain."""

from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_in import stand_in_step

from shoal.proto.block_hash import KEY_BYTES, adopt_chain, chain_hashes, hash_block, root_key
from shoal.proto.errors import InvalidRequestError
from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig
from shoal.workers.core.sequence import RequestTimings, Sequence

BS = 4
_arrivals = itertools.count()


def reference_chain(ids: list[int], bs: int, extra: bytes = b"") -> list[bytes]:
    """The scheme written out independently: SHA-256(parent || int64 LE tokens || extra)."""
    parent = hashlib.sha256(b"shoal.prefix-cache.sha256.v1" + bs.to_bytes(4, "little")).digest()
    out = []
    for j in range(len(ids) // bs):
        parent = hashlib.sha256(parent + np.asarray(ids[j * bs : (j + 1) * bs], "<i8").tobytes() + extra).digest()
        out.append(parent)
    return out


def seq_of(rid: str, toks: list[int], max_tokens: int = 4, block_hashes: list[bytes] | None = None) -> Sequence:
    s = Sequence(
        rid,
        list(toks),
        len(toks),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        next(_arrivals),
        0,
        RequestTimings(0.0),
    )
    if block_hashes is not None:
        s.block_hashes = block_hashes
    return s


def run_to_end(bm: BlockManager, *seqs: Sequence, budget: int = 64) -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), bm, max_model_len=1 << 20, eos_token_ids=[]
    )
    for s in seqs:
        sched.add(s)
    for _ in range(1000):
        if not sched.has_unfinished():
            return
        stand_in_step(sched)
    raise AssertionError("the sequences did not finish")


def test_keys_are_the_sha256_chain_written_down():
    ids = [random.Random(0).randrange(200_000) for _ in range(1000)]
    for bs in (1, 4, 16):
        assert chain_hashes(ids, bs) == reference_chain(ids, bs)
    assert chain_hashes(ids, 16, extra=b"lora:7") == reference_chain(ids, 16, b"lora:7")
    assert all(type(h) is bytes and len(h) == KEY_BYTES for h in chain_hashes(ids, 16))
    # Pinned, as routers and workers of other processes and releases must compute it (a change renames _VERSION).
    assert chain_hashes(list(range(32)), 16)[-1].hex() == GOLDEN


GOLDEN = "25feca50610318faa6cf918e98ef0bfbe6902ba6a25971c407222205e89324fc"


def test_chain_is_extended_not_rehashed_and_stops_where_asked():
    ids = list(range(100, 170))
    full = chain_hashes(ids, BS)
    assert len(full) == 70 // BS and chain_hashes(ids[:3], BS) == []
    start = full[:5]
    out = chain_hashes(ids, BS, start)
    assert out is start and out == full
    assert chain_hashes(ids, BS, num_blocks=7) == full[:7]
    assert chain_hashes(ids, BS, full[:9], num_blocks=7) == full[:9]  # (already past it: unchanged)
    assert hash_block(None, ids[:BS]) == full[0] and hash_block(full[0], ids[BS : 2 * BS]) == full[1]
    # The parent is part of the key: the same tokens after another prefix give another key.
    assert hash_block(full[0], ids[:BS]) != full[0] and root_key(BS) != root_key(2 * BS)
    assert chain_hashes(ids, BS, extra=b"x") != full


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, "7"])
def test_token_ids_that_cannot_be_keyed_are_refused_with_the_field(bad):
    with pytest.raises(InvalidRequestError) as e:
        chain_hashes([1, 2, bad, 4], BS)
    assert e.value.field == "prompt"


def test_the_engine_computes_the_routers_keys_for_prompt_and_output():
    """Sequences hashed by the block manager itself (no keys given): every
    key it uses, prompt and generated blocks, is the router's chain."""
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    rng = random.Random(3)
    seqs = [seq_of(str(i), [rng.randrange(50) for _ in range(rng.randrange(1, 30))], max_tokens=9) for i in range(6)]
    run_to_end(bm, *seqs, budget=8)  # (chunked: keys are made a few blocks at a time)
    for s in seqs:
        chain = chain_hashes(s.token_ids, BS)
        assert s.block_hashes == chain[: len(s.block_hashes)] and len(s.block_hashes) >= s.num_prompt_tokens // BS
        assert s.block_hashes[: s.num_prompt_tokens // BS] == chain_hashes(s.token_ids[: s.num_prompt_tokens], BS)
    assert {b.block_hash for b in bm.pool.blocks if b.block_hash is not None} <= {
        h for s in seqs for h in chain_hashes(s.token_ids, BS)
    }


def test_keys_from_the_router_are_used_and_extended_not_recomputed():
    """Given keys are taken as they are (marker keys here, which no hashing
    would make), and the output's blocks chain from the last of them."""
    toks = list(range(10, 22))  # 3 full blocks
    given_keys = [bytes([i]) * KEY_BYTES for i in range(1, 4)]
    s = seq_of("a", toks, max_tokens=6, block_hashes=adopt_chain(given_keys, len(toks), BS))
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    run_to_end(bm, s)
    assert s.block_hashes[:3] == given_keys and len(s.block_hashes) == 18 // BS
    assert s.block_hashes[3] == hash_block(given_keys[2], s.token_ids[12:16])
    assert given_keys == [bytes([i]) * KEY_BYTES for i in range(1, 4)]  # the router's list is not extended
    # The next request with the router's (honest) keys for another prompt misses: only keys decide.
    other = seq_of("b", toks + [1], block_hashes=chain_hashes(toks, BS))
    assert bm.get_computed_blocks(other) == []
    again = seq_of("c", toks + [1], block_hashes=list(given_keys))
    assert len(bm.get_computed_blocks(again)) == 3


def test_adopt_chain_takes_only_one_well_formed_key_per_full_block():
    toks = list(range(40))
    chain = chain_hashes(toks, 16)
    adopted = adopt_chain(chain, 40, 16)
    assert adopted == chain and adopted is not chain
    assert adopt_chain(tuple(chain), 40, 16) == chain
    assert adopt_chain(chain_hashes(toks, 8), 40, 16) == []  # a router with another block size
    assert adopt_chain(chain_hashes(toks, 32), 40, 16) == []
    assert adopt_chain(chain[:1], 40, 16) == []
    assert adopt_chain([hash(tuple(toks[:16])), hash(tuple(toks[16:32]))], 40, 16) == []  # the old int keys
    assert adopt_chain([chain[0], chain[1][:16]], 40, 16) == []
    assert adopt_chain([chain[0], bytearray(chain[1])], 40, 16) == []
    assert adopt_chain(None, 40, 16) == [] and adopt_chain(b"x" * 64, 40, 16) == []
    assert adopt_chain([], 10, 16) == []


def test_same_tokens_after_another_parent_is_not_a_hit():
    """A block whose own tokens match a cached one but whose parent chain
    differs is a miss (the token-only comparison that let vLLM's
    GHSA-rm76-4mrf-v9r8 through is gone), and one whose chain matches is a hit."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    p1, p2, x = [1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7, 7]
    a = seq_of("a", p1 + x + [9], max_tokens=1)
    run_to_end(bm, a)
    key_x_after_p1 = chain_hashes(p1 + x, BS)[1]
    assert bm.pool.lookup(key_x_after_p1) is not None  # cached (and free again)
    b = seq_of("b", p2 + x + [9])
    assert bm.get_computed_blocks(b) == []
    assert chain_hashes(p2 + x, BS)[1] != key_x_after_p1
    # Even with its own first block cached too, the tail stays keyed by its own parent.
    run_to_end(bm, seq_of("c", p2 + [8], max_tokens=1))
    hits = bm.get_computed_blocks(seq_of("d", p2 + x + [9]))
    assert len(hits) == 1 and bm.pool.blocks[hits[0]].block_hash == chain_hashes(p2, BS)[0]
    assert len(bm.get_computed_blocks(seq_of("e", p1 + x + [9]))) == 2


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(a=st.lists(st.integers(0, 2), min_size=1, max_size=24), b=st.lists(st.integers(0, 2), min_size=1, max_size=24))
def test_a_hit_covers_exactly_the_common_prefix(a, b):
    """From a 3-token alphabet blocks repeat often at other positions and
    after other parents; a hit still covers exactly the common full blocks
    (but never b's last token). a's output token (the stand-in's) is never
    in the alphabet, so what b can match of a is a's prompt."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    run_to_end(bm, seq_of("a", a, max_tokens=1))
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert len(bm.get_computed_blocks(seq_of("b", b))) == min(common // BS, (len(b) - 1) // BS)


def test_a_workers_engine_takes_the_keys_its_router_sent(tiny_model, monkeypatch):
    """Carried, not hashed twice: a Worker hands GenerateRequest.block_hashes
    to its engine, whose sequence starts from those very key objects."""
    import asyncio

    from shoal.proto import block_hash
    from shoal.proto.messages import GenerateRequest
    from shoal.workers import EngineArgs
    from shoal.workers.worker import Worker

    async def main():
        worker = Worker(EngineArgs(model=tiny_model, num_kv_blocks=64, num_threads=1), max_waiting=8)
        prompt = list(range(10, 70))  # three full blocks of 16, and output that fills a fourth
        keys = chain_hashes(prompt, 16)
        seen = {}
        real_adopt = block_hash.adopt_chain

        def spy(hashes, num_tokens, block_size):
            seen["adopted"] = real_adopt(hashes, num_tokens, block_size)
            return seen["adopted"]

        monkeypatch.setattr("shoal.workers.llm_engine.adopt_chain", spy)
        calls = []
        monkeypatch.setattr(
            "shoal.workers.core.sequence.chain_hashes",
            lambda *a, **k: calls.append(len(a[2])) or chain_hashes(*a, **k),
        )
        req = GenerateRequest(
            "keys", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), block_hashes=keys
        )
        out = [d async for d in worker.generate(req)]
        await worker.engine.shutdown()
        return out, seen, calls, keys

    out, seen, calls, keys = asyncio.run(main())
    assert out[-1].finished is not None
    assert len(keys) == 3 and all(a is k for a, k in zip(seen["adopted"][:3], keys))
    assert len(seen["adopted"]) == 4  # then extended over the output's block
    # The engine hashed no prompt block itself: any chain it extended already held the router's three keys.
    assert all(n >= 3 for n in calls)
