"""Tensor parallelism on CPU with gloo: the sharded model against the
single-rank one, the refusal of sizes that cannot split a model, and a rank
that dies."""

from __future__ import annotations

import re
import time

import pytest
from tiny_models import make_tiny_model
from tp_helpers import compare_with_k1, tp_prompts

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.models.config import ModelConfig

# Small caches and token budgets so that the steps mix chunked prefills,
# decodes, prefix-cache hits and preemptions: every kind of step input.
ENGINE = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=48, max_num_seqs=6)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, str]:
    return {
        "4 heads, 2 KV, untied": make_tiny_model(str(tmp_path_factory.mktemp("tp-4-2"))),
        "8 heads, 2 KV, tied, bias": make_tiny_model(
            str(tmp_path_factory.mktemp("tp-8-2")), num_attention_heads=8, tie_word_embeddings=True, attention_bias=True
        ),
        # one KV head: at K = 2 each rank keeps a replica of it
        "4 heads, 1 KV (replicated)": make_tiny_model(str(tmp_path_factory.mktemp("tp-4-1")), num_key_value_heads=1),
        # a vocabulary that 2 does not divide: the LM head is padded
        "odd vocab": make_tiny_model(str(tmp_path_factory.mktemp("tp-odd")), vocab_size=509),
    }


@pytest.mark.parametrize(
    "name", ["4 heads, 2 KV, untied", "8 heads, 2 KV, tied, bias", "4 heads, 1 KV (replicated)", "odd vocab"]
)
def test_k2_greedy_equals_k1(ray_cluster, tp_models, name):
    diff, ref_stats, stats = compare_with_k1(name, tp_models[name], 2, tp_prompts(500, n=10), 20, ENGINE)
    assert diff < 1e-3
    # The workload went through every kind of step input.
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert (stats.num_preemptions, stats.num_total_blocks) == (ref_stats.num_preemptions, ref_stats.num_total_blocks)


@pytest.mark.parametrize("name", ["4 heads, 2 KV, untied", "odd vocab"])
def test_k2_gguf_blocks_equal_k1(ray_cluster, tp_models, name, tmp_path):
    """--quantization gguf, every matrix in a block type (the parts of q/k/v
    in three): each rank keeps whole rows, and whole blocks of the
    row-parallel layers' columns; a padded vocabulary pads with zero blocks."""
    from test_gguf_quantization import TYPES
    from tiny_gguf import write_llama_gguf

    path = write_llama_gguf(tp_models[name], str(tmp_path / "q.gguf"), TYPES)
    prompts = tp_prompts(500, n=10)
    # The blocks expanded per call: equal to the float sums' order, so each rank holds the right blocks.
    diff, _, _ = compare_with_k1(
        f"{name}, gguf", path, 2, prompts, 20, dict(ENGINE, quantization="gguf", cpu_kernels=False)
    )
    assert diff < 1e-3
    # The kernels quantize each rank's activation blocks to 8 bits: a last-bit difference of the
    # all-reduced sums can round one value to the next step, so the logits differ by more
    # (0.13 here, where the logits span ~10); the greedy tokens stay equal (compare_with_k1).
    compare_with_k1(f"{name}, gguf, kernels", path, 2, prompts, 20, dict(ENGINE, quantization="gguf"))


def test_k2_compressed_tensors_w4a16_equals_k1(ray_cluster, tp_models, tmp_path):
    """A W4A16 checkpoint in groups of 32: each rank takes whole rows of the
    column-parallel layers and whole packed words and scale groups of the
    row-parallel ones (64 input features of down_proj's 128 on each)."""
    from ct_checkpoints import write_checkpoints

    path = str(tmp_path / "w4a16")
    write_checkpoints(tp_models["4 heads, 2 KV, untied"], path, str(tmp_path / "expanded"), "w4a16", group_size=32)
    diff, _, _ = compare_with_k1("w4a16", path, 2, tp_prompts(500, n=10), 20, ENGINE)
    assert diff < 1e-3


@pytest.mark.parametrize("name", ["4 heads, 2 KV, untied", "4 heads, 1 KV (replicated)"])
def test_k2_lora_adapters_equal_k1(ray_cluster, tp_models, name, tmp_path):
    """LoRA under K = 2: column layers keep A whole and their rows of each
    part's B (a replicated KV head's too), row layers their columns of A,
    whose partial update the all-reduce sums; two adapters and the base in
    one batch, through preemptions and chunked prefills."""
    from test_lora_adapter import make_adapter

    from shoal.workers.lora import LoRARequest

    model = tp_models[name]
    reqs = [
        LoRARequest(f"r{r}", i + 1, make_adapter(model, str(tmp_path / f"r{r}"), r, seed=r))
        for i, r in enumerate((4, 8))
    ]
    prompts = tp_prompts(500, n=10)
    loras = [[None, *reqs][i % 3] for i in range(len(prompts))]
    engine = dict(ENGINE, enable_lora=True, max_loras=2)
    diff, _, stats = compare_with_k1(f"{name}, LoRA", model, 2, prompts, 20, engine, lora_request=loras)
    assert diff < 1e-3 and stats.num_preemptions > 0


def test_k2_guided_sampling_equals_k1(ray_cluster, tp_models):
    """Rank 0 alone builds and applies the grammar's mask: the sharded engine's
    guided, seeded replies equal the single rank's (a padded vocabulary too)."""
    from shoal.proto.structured_params import StructuredOutputsParams

    so = StructuredOutputsParams(regex=r"[a-z]{2,8}( [0-9]{1,3}){1,4}")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=so) for s in range(6)]
    prompts = tp_prompts(500, n=6)
    for name in ("4 heads, 2 KV, untied", "odd vocab"):
        path = tp_models[name]
        with LLM(path, **ENGINE) as one:
            ref = [o.text for o in one.generate(prompts, params)]
        with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
            got = [o.text for o in two.generate(prompts, params)]
        assert got == ref and all(re.fullmatch(so.regex, t) for t in got), (name, got)


def test_k2_host_tier_gives_back_what_the_pool_lost_with_the_same_tokens(ray_cluster, tp_models):
    """The host KV tier under tensor parallelism: every rank saves its heads'
    slice of an evicted block, and loads it back, in the same step."""
    path = tp_models["4 heads, 2 KV, untied"]
    prompts = tp_prompts(500, n=8, seed=3)
    shared = prompts[1][:40]  # the prefix every odd prompt shares: 5 blocks of 8
    # Sent one at a time, the shared prefix first and last: the prompts between evict it from 24 blocks.
    order = [shared + [7, 8, 9]] + [p for i, p in enumerate(prompts) if i % 2 == 0] + [shared + [10, 11]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(**tier) -> tuple[list[list[int]], int, dict]:
        with LLM(path, tensor_parallel_size=2, **ENGINE, **tier) as llm:
            pool = llm.engine.block_manager.pool
            outs = [llm.generate([p], params)[0].token_ids for p in order[:-1]]
            before = pool.num_hit_tokens
            outs.append(llm.generate([order[-1]], params)[0].token_ids)
            return outs, pool.num_hit_tokens - before, llm.engine.kv_tier_stats()

    off, off_cached, _ = run()
    on, on_cached, tiers = run(kv_offload_host_bytes=1 << 20)
    assert on == off
    # The last prompt's prefix: what the pool kept of it (device hits), the rest from the tier.
    assert on_cached == off_cached < len(shared)
    assert tiers["host"].hit_tokens == len(shared) - off_cached
    # The bytes are all ranks' together: each holds its slice (1 of 2 KV heads) of every slot.
    per_rank_block = 2 * 2 * 8 * 1 * 16 * 4  # K and V, 2 layers, 8 tokens, 1 head of 16 dims, float32
    assert tiers["host"].total_blocks == (1 << 20) // (2 * per_rank_block)


def test_k2_disk_tier_every_rank_writes_its_slice_and_a_missing_one_is_computed(ray_cluster, tp_models, tmp_path):
    """The disk tier under tensor parallelism: each rank writes its heads'
    slice of a file; a restarted engine reads them back with the tokens of
    no tier; with one rank's slices gone, both ranks compute those blocks."""
    path = tp_models["4 heads, 2 KV, untied"]
    prompts = tp_prompts(500, n=4, seed=5)
    shared = prompts[1][:40]  # 5 blocks of 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tier = dict(kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20)

    def last_turn() -> tuple[list[int], dict]:
        with LLM(path, tensor_parallel_size=2, **ENGINE, **tier) as llm:
            return llm.generate([shared + [10, 11]], params)[0].token_ids, llm.engine.kv_tier_stats()

    off, tiers = last_turn()  # computed (the tier is empty), then written by every rank
    assert tiers["disk"].hit_tokens == 0 and tiers["disk"].saved_blocks > 0
    files = [f for f in tmp_path.rglob("*") if f.is_file() and not f.name.startswith(".")]
    slices = [f for f in files if f.name.endswith(".kv.rank1")]
    assert slices and {f.name + ".rank1" for f in files if f.suffix == ".kv"} == {f.name for f in slices}
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)

    on, tiers = last_turn()  # restarted: both slices of each block from disk
    assert on == off and tiers["disk"].hit_tokens == len(shared) and tiers["disk"].failed_blocks == 0

    for f in slices:  # rank 1's slices gone, rank 0's still there: the ranks must agree to compute them
        f.unlink()
    again, tiers = last_turn()
    assert again == off and tiers["disk"].failed_blocks >= 1  # offered by the index, then computed


def test_k2_cluster_tier_every_rank_publishes_its_slice_and_a_damaged_one_is_computed(ray_cluster, tp_models):
    """The cluster tier under tensor parallelism: each rank publishes its
    heads' slice of a block; a fresh engine loads both slices with the
    tokens it computed; with rank 1's slices damaged (offered by the index,
    refused by rank 1's checksum), both ranks compute those blocks."""
    import ray

    from shoal.workers.kv_transfer import cluster_tier

    path = tp_models["4 heads, 2 KV, untied"]
    prompt = tp_prompts(500, n=4, seed=7)[2][:40] + [10, 11]  # 5 full blocks of 8 before its last token
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def turn() -> tuple[list[int], dict]:
        with LLM(path, tensor_parallel_size=2, kv_cluster_tier="object-store", **ENGINE) as llm:
            return llm.generate([prompt], params)[0].token_ids, llm.engine.kv_tier_stats()

    def slices(store) -> list[bytes]:
        return list(store.store.entries)

    cluster_tier.reset_process_store()
    try:
        off, tiers = turn()  # computed (the tier is empty), then published by every rank
        assert tiers["cluster"].hit_tokens == 0 and tiers["cluster"].saved_blocks > 0
        store = cluster_tier.job_store(1)  # the engine's, found by name
        keys = ray.get(store.__ray_call__.remote(slices))
        rank_1 = [k for k in keys if k.endswith(b"#1")]
        assert rank_1 and sorted(k[:-1] for k in rank_1) == sorted(k[:-1] for k in keys if k.endswith(b"#0"))

        on, tiers = turn()  # a fresh engine: both slices of each block from the cluster
        assert on == off and tiers["cluster"].hit_tokens == 40 and tiers["cluster"].failed_blocks == 0

        def damage(store) -> None:  # rank 1's bytes no longer match their checksum
            for key, block in store.store.entries.items():
                if key.endswith(b"#1"):
                    block.crc32 ^= 1

        ray.get(store.__ray_call__.remote(damage))
        again, tiers = turn()  # rank 0's slices land, rank 1's fail: the ranks agree to compute them
        assert again == off and tiers["cluster"].failed_blocks >= 1
    finally:
        cluster_tier.reset_process_store()
    assert not [n for n in ray.util.list_named_actors() if "shoal-kv-cluster" in str(n)]


def test_k2_holds_twice_the_blocks_in_the_same_bytes(ray_cluster, tp_models):
    path = tp_models["4 heads, 2 KV, untied"]
    budget = dict(kv_cache_memory_bytes=1 << 20, block_size=16)
    with LLM(path, **budget) as one, LLM(path, tensor_parallel_size=2, **budget) as two:
        n1, n2 = one.engine.stats().num_total_blocks, two.engine.stats().num_total_blocks
        assert n2 == 2 * n1
        # and both serve
        sp = SamplingParams(temperature=0, max_tokens=5)
        assert one.generate([[5, 6, 7]], sp)[0].token_ids == two.generate([[5, 6, 7]], sp)[0].token_ids


def test_a_dead_rank_fails_the_engine_fast(ray_cluster, tp_models):
    import ray

    llm = LLM(tp_models["4 heads, 2 KV, untied"], tensor_parallel_size=2)
    try:
        llm.engine.check_health()
        ray.kill(llm.engine.model_executor.workers[0])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                llm.engine.check_health()
            except RuntimeError as e:
                assert "rank 1" in str(e)
                break
            time.sleep(0.2)
        else:
            raise AssertionError("check_health never noticed the dead rank")
    finally:
        llm.shutdown()
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if "shoal-tp" in str(n)]


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("size, reason", [(4, "6 attention heads"), (3, "2 KV heads"), (0, ">= 1"), (2.0, ">= 1")])
def test_sizes_that_cannot_split_are_refused_with_the_reason(size, reason):
    with pytest.raises(ValueError, match=reason):
        _cfg().check_tp_size(size)
    _cfg().check_tp_size(2)
    _cfg(num_key_value_heads=1).check_tp_size(6)  # one KV head, replicated
    with pytest.raises(ValueError, match="MLP width 100"):
        _cfg(intermediate_size=100, num_attention_heads=8).check_tp_size(8)


def test_a_bad_size_is_refused_before_any_actor_starts(ray_cluster, tiny_model):
    import ray

    groups = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(tiny_model, tensor_parallel_size=3)
    assert len(ray.util.placement_group_table()) == groups  # no placement group, so no actor
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if "shoal-tp" in str(n)]


@pytest.mark.slow
def test_smollm2_k3_greedy_equals_k1(ray_cluster):
    """SmolLM2-135M: 9 heads and 3 KV heads, so K = 3 gives each rank 3 heads and 1 KV head."""
    engine = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=128, quantization="none")
    diff, _, _ = compare_with_k1("SmolLM2-135M", None, 3, tp_prompts(49152, n=8, seed=1), 16, engine)
    assert diff < 1e-2
