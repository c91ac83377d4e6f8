"""The host KV tier behind the offloading connector (workers/kv_transfer/):
blocks the paged pool evicts come back from host memory instead of being
prefilled again, with the very tokens a recompute gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shoal.proto.block_hash import chain_hashes
from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.kv_transfer.base import KVLoadError
from shoal.workers.kv_transfer.disk_tier import DiskTierStorage
from shoal.workers.kv_transfer.factory import kv_cache_spec
from shoal.workers.kv_transfer.host_tier import HostTierIndex, HostTierStorage, block_shape, num_host_slots
from shoal.workers.kv_transfer.keys import checkpoint_digest, engine_fingerprint

BLOCK = 16
POOL_BLOCKS = 24  # the paged pool: a few prompts' worth, so later prompts evict earlier ones
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


SHARED = _prompt(0, 96)  # 6 full blocks
WORKLOAD = [
    SHARED + _prompt(1, 20),
    *[_prompt(100 + i, 150) for i in range(4)],  # unrelated: they push SHARED's blocks out of the pool
    SHARED[:40] + _prompt(3, 30),  # SHARED's first 2 blocks: from the host tier, or prefilled again
    SHARED + _prompt(2, 20),  # those 2 from the pool, the other 4 from the host tier
]
HOST_HITS = (2 + 4) * BLOCK


def _block_bytes(engine: LLMEngine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4


def _engine_config(model: str):
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    return load_model_files(model).config


def _engine(model: str, host_blocks: int = 0, **kw) -> LLMEngine:
    host = 0
    if host_blocks:
        probe = 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny model: 2 layers, 2 KV heads of 16 dims, float32
        host = host_blocks * probe
    return LLMEngine(model=model, num_kv_blocks=POOL_BLOCKS, num_threads=1, kv_offload_host_bytes=host, **kw)


def _run(engine: LLMEngine, prompts, params: SamplingParams, salt: str | None = None) -> list[list[int]]:
    """Each prompt to its end before the next starts."""
    outs = []
    for i, ids in enumerate(prompts):
        rid = f"r{i}-{len(engine.requests)}-{engine.num_steps}"
        engine.add_request(GenerateRequest(rid, list(ids), params, cache_salt=salt))
        tokens = []
        while engine.has_unfinished_requests():
            for d in engine.step():
                tokens += d.new_token_ids
        outs.append(tokens)
    return outs


def run_together(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """The prompts (by request id) added at once, run to their ends: each one's tokens."""
    for rid, ids in prompts.items():
        engine.add_request(GenerateRequest(rid, list(ids), params))
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for d in engine.step():
            outs[d.request_id] += d.new_token_ids
    return outs


def run_once(engine: LLMEngine, prompts, params: SamplingParams = GREEDY) -> tuple[list[list[int]], dict]:
    """_run, then the engine's tier counters, and the engine shut down (its writes done)."""
    try:
        return _run(engine, prompts, params), engine.kv_tier_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = _engine(tiny_model)
    try:
        assert _block_bytes(engine) == 2 * 2 * BLOCK * 2 * 16 * 4, "the tiny model changed: fix _engine's probe"
        return {name: _run(engine, WORKLOAD, p) for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_blocks_from_the_host_tier_give_the_tokens_a_prefill_gives(tiny_model, reference, kind):
    out, tiers = run_once(_engine(tiny_model, host_blocks=64), WORKLOAD, GREEDY if kind == "greedy" else SEEDED)
    host = tiers["host"]
    assert out == reference[kind]
    assert host.saved_blocks > 0
    assert host.hit_tokens == HOST_HITS
    assert host.loaded_blocks == HOST_HITS // BLOCK
    # Each load was timed: what a block costs (load_us / loaded_blocks), and the loads by time taken.
    assert host.load_us > 0 and 1 <= sum(host.load_buckets) <= host.loaded_blocks


def test_written_through_the_tier_holds_every_finished_prefill(tiny_model, reference, monkeypatch):
    """On a GPU the tier is written through (offloading.saves_prefills): every
    full prompt block is saved after the forward that finishes its prefill,
    once, and an eviction saves nothing more."""
    from shoal.workers.kv_transfer import offloading

    monkeypatch.setattr(offloading, "saves_prefills", lambda options: True)
    out, tiers = run_once(_engine(tiny_model, host_blocks=64), WORKLOAD, GREEDY)
    host = tiers["host"]
    assert out == reference["greedy"] and host.hit_tokens == HOST_HITS
    # no output fills a block here: the blocks saved are the prompts' full blocks, each once
    full_blocks = {tuple(p[: BLOCK * (i + 1)]) for p in WORKLOAD for i in range(len(p) // BLOCK)}
    assert host.saved_blocks == len(full_blocks) <= 64


def test_the_tiers_report_the_chain_hashes_they_hold_for_the_router(tiny_model):
    """offloaded_hashes: the router's keys (block_hash.chain_hashes) of what
    the host tier holds and the device no longer does, latest first; gone
    from the report once the tier drops them too."""
    engine = _engine(tiny_model, host_blocks=64)
    try:
        _run(engine, WORKLOAD[:5], GREEDY)  # SHARED, used first, is evicted to the host tier by the rest
        shared = chain_hashes(SHARED, BLOCK)
        assert not set(shared) & set(engine.block_manager.pool.cached_hashes_mru(1000))
        offloaded = engine.kv_connector.offloaded_hashes(1000)
        assert set(shared) <= set(offloaded)
        assert engine.kv_connector.offloaded_hashes(2) == offloaded[:2]
        assert engine.prefill_us_per_token > 0  # measured on its prompts' steps: what a fetch is weighed against
    finally:
        engine.shutdown()
    small = _engine(tiny_model, host_blocks=4)
    try:
        _run(small, WORKLOAD[:5], GREEDY)
        assert len(small.kv_connector.offloaded_hashes(1000)) == 4  # the tier holds 4: the rest were dropped
    finally:
        small.shutdown()


def test_without_a_tier_the_evicted_prefix_is_prefilled_again(tiny_model):
    """The workload's point: the pool alone has lost SHARED by its second use."""
    engine = _engine(tiny_model)
    try:
        _run(engine, WORKLOAD[:5], GREEDY)
        pool = engine.block_manager.pool
        hit_tokens_before = pool.num_hit_tokens
        _run(engine, [WORKLOAD[5]], GREEDY)
    finally:
        engine.shutdown()
    assert pool.num_hit_tokens == hit_tokens_before  # SHARED held nowhere: no hit


def test_a_full_tier_drops_its_least_recently_used_blocks(tiny_model, reference):
    out, tiers = run_once(_engine(tiny_model, host_blocks=4), WORKLOAD)
    host = tiers["host"]
    assert out == reference["greedy"]
    assert host.used_blocks == host.total_blocks == 4
    assert host.evicted_blocks > 0


def test_two_salts_never_share_a_tier_block(tiny_model):
    engine = _engine(tiny_model, host_blocks=64)
    try:
        _run(engine, WORKLOAD[:5], GREEDY, salt="tenant-a")
        _run(engine, [WORKLOAD[6]], GREEDY, salt="tenant-b")
        assert engine.kv_tier_stats()["host"].hit_tokens == 0
        _run(engine, [WORKLOAD[6]], GREEDY, salt="tenant-a")
        assert engine.kv_tier_stats()["host"].hit_tokens == 6 * BLOCK
    finally:
        engine.shutdown()


def test_an_adapters_blocks_come_back_under_it_alone(tiny_model, tmp_path):
    """LoRA: blocks computed under an adapter are keyed under it in the tier
    too; they come back, with the tokens a prefill gives, for that adapter
    and never for the base model."""
    from test_lora_adapter import make_adapter

    from shoal.workers import LLM
    from shoal.workers.lora import LoRARequest

    lora = LoRARequest("alpha", 1, make_adapter(tiny_model, str(tmp_path / "alpha"), 4, seed=10))
    host = 64 * 2 * 2 * BLOCK * 2 * 16 * 4

    def run(host_bytes: int, prompts, loras) -> tuple[list[list[int]], dict]:
        kw = dict(num_kv_blocks=POOL_BLOCKS, num_threads=1, enable_lora=True, max_loras=1)
        with LLM(tiny_model, kv_offload_host_bytes=host_bytes, **kw) as llm:
            outs = [llm.generate([p], GREEDY, lora_request=r)[0].token_ids for p, r in zip(prompts, loras, strict=True)]
            return outs, llm.engine.kv_tier_stats()

    ref, _ = run(0, WORKLOAD, [lora] * len(WORKLOAD))
    out, tiers = run(host, WORKLOAD, [lora] * len(WORKLOAD))
    assert out == ref and tiers["host"].hit_tokens == HOST_HITS
    # SHARED's blocks, evicted under the adapter: the base model's request finds none; the adapter's does.
    _, tiers = run(host, [*WORKLOAD[:5], WORKLOAD[6], WORKLOAD[6]], [lora] * 5 + [None, lora])
    # All 6 of SHARED's blocks for the adapter's request, the most it can take: so none for the base's.
    assert tiers["host"].hit_tokens == 6 * BLOCK


def test_two_requests_loading_one_block_at_once_both_get_it(tiny_model, reference):
    """Concurrent loads of one block: two requests admitted in the same step
    whose prefix the host tier holds. The first loads it; the second finds
    those fresh blocks in the index (their load comes before the forward)."""
    engine = _engine(tiny_model, host_blocks=64)
    try:
        _run(engine, WORKLOAD[:5], GREEDY)  # SHARED is in the tier only, now
        outs = run_together(engine, {"twin-a": WORKLOAD[6], "twin-b": WORKLOAD[6]}, GREEDY)
        host = engine.kv_tier_stats()["host"]
    finally:
        engine.shutdown()
    assert outs["twin-a"] == outs["twin-b"] == reference["greedy"][6]
    assert host.loaded_blocks == 6  # once: the twin's are device hits on the loaded blocks


def test_a_load_that_fails_is_computed_again(tiny_model, reference, monkeypatch):
    engine = _engine(tiny_model, host_blocks=64)
    connector = engine.runner.kv_connector
    real = type(connector).start_load_kv
    failed = []

    def start_load_kv(self, metadata):
        if metadata.loads and not failed:  # the first loads fail: a corrupted copy, say
            failed.extend(b for _, b in metadata.loads)
            real(self, type(metadata)(saves=metadata.saves))  # the saves still happen
            raise KVLoadError(failed, "checksum mismatch (test)")
        real(self, metadata)

    monkeypatch.setattr(type(connector), "start_load_kv", start_load_kv)
    out, tiers = run_once(engine, WORKLOAD)
    host = tiers["host"]
    assert len(failed) == 2 and out == reference["greedy"]
    # The 2 that failed were offered, then computed; the last prompt found them in the pool.
    assert host.hit_tokens == HOST_HITS


NARROW = [("bfloat16", torch.bfloat16, 2), ("fp8", torch.float8_e4m3fn, 4)]


@pytest.mark.parametrize("name, dtype, ratio", NARROW)
def test_a_narrower_storage_dtype_holds_more_blocks(tiny_model, name, dtype, ratio):
    engine = _engine(tiny_model, host_blocks=64, kv_offload_dtype=name)
    try:
        outs = _run(engine, WORKLOAD, GREEDY)
        host = engine.kv_tier_stats()["host"]
    finally:
        engine.shutdown()
    assert [len(o) for o in outs] == [GREEDY.max_tokens] * len(WORKLOAD)
    # The same bytes hold 2 or 4 times the float32 blocks, and the evicted prefix comes back from them.
    assert host.total_blocks == 64 * ratio and host.hit_tokens == HOST_HITS


@pytest.mark.parametrize("name, dtype, ratio", NARROW)
def test_every_tier_gives_back_the_values_rounded_to_its_storage_dtype(tiny_model, tmp_path, name, dtype, ratio):
    """What a load writes into the paged cache is the saved block rounded to
    the storage dtype (fp8: saturated at +-448, as an unscaled cast is) and
    nothing else, from host memory and from a file alike."""
    spec = kv_cache_spec(_engine_config(tiny_model), BLOCK, torch.float32, 1)
    assert num_host_slots(spec, 1 << 20, dtype) == ratio * num_host_slots(spec, 1 << 20, torch.float32)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((2, spec.num_layers, 6, BLOCK, spec.num_kv_heads, spec.head_dim), generator=gen) * 100
    kv[0, 0, 1, 0, 0, 0] = 1000.0  # past fp8's range
    expected = kv[:, :, [1, 3]].to(dtype).to(torch.float32)
    host = HostTierStorage(spec, 4, dtype)
    host.save(kv, [1, 3], [0, 2])
    disk = DiskTierStorage(block_shape(spec), dtype)
    keys = [bytes([i]) * 32 for i in range(2)]
    disk.save(kv, str(tmp_path / "blocks.kv"), [1, 3], keys)
    disk.flush()
    kv[:, :, [1, 3]] = 0.0
    host.load(kv, [0, 2], [4, 5])
    assert torch.equal(kv[:, :, [4, 5]], expected)
    assert all(disk.load(kv, str(tmp_path / "blocks.kv"), i, keys[i], b) for i, b in enumerate([1, 3]))
    disk.shutdown()
    assert torch.equal(kv[:, :, [1, 3]], expected)
    assert (expected[0, 0, 0, 0, 0, 0].item() == 448.0) == (name == "fp8")


def test_index_evicts_the_least_recently_used_unpinned_slot():
    index = HostTierIndex(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert index.allocate(a) == 0 and index.allocate(b) == 1
    index.pin(a)  # a feeds this step's loads: b goes, though a is older
    assert index.allocate(c) == 1 and a in index and b not in index
    index.pin(c)
    assert index.allocate(b"d" * 32) is None  # every slot feeds a load
    index.unpin_all()
    index.discard(a)
    assert a not in index and index.allocate(b"e" * 32) == 0


def test_fingerprint_is_the_same_in_every_process_and_changes_with_the_settings(tiny_model):
    digest = checkpoint_digest(tiny_model)
    args = dict(
        dtype="torch.float32",
        weight_dtype="torch.float32",
        quantization="auto@cpu",
        kv_cache_dtype="torch.float32",
        block_size=16,
        tp_size=1,
    )
    fp = engine_fingerprint(digest, **args)
    code = (
        "from shoal.workers.kv_transfer.keys import checkpoint_digest, engine_fingerprint;"
        f"print(engine_fingerprint(checkpoint_digest({tiny_model!r}), **{args!r}).hex())"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == fp.hex()
    for field, other in (("block_size", 32), ("kv_cache_dtype", "torch.bfloat16"), ("tp_size", 2)):
        assert engine_fingerprint(digest, **{**args, field: other}) != fp
    assert engine_fingerprint(b"another checkpoint", **args) != fp


def test_bad_tier_settings_are_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_offload_host_bytes must be an integer"):
        LLMEngine(model=tiny_model, kv_offload_host_bytes=-1)
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(model=tiny_model, num_kv_blocks=8, kv_offload_host_bytes=100)
    with pytest.raises(ValueError, match="needs a tier"):
        LLMEngine(model=tiny_model, num_kv_blocks=8, kv_connector="offloading")
    with pytest.raises(ValueError, match="expected one of offloading"):
        LLMEngine(model=tiny_model, num_kv_blocks=8, kv_connector="nixl")
    with pytest.raises(ValueError, match="is not a KVConnectorBase"):
        LLMEngine(model=tiny_model, num_kv_blocks=8, kv_connector="collections:OrderedDict")
    # Tensor parallelism: every tier on every rank (tests/test_tensor_parallel.py); other connectors on one.
    with pytest.raises(ValueError, match="runs on one rank for now"):
        LLMEngine(model=tiny_model, tensor_parallel_size=2, kv_connector="collections:OrderedDict")
