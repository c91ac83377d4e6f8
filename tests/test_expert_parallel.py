"""Expert parallelism: the MoE layer's ranks each hold whole experts (EP)
or a slice of every expert (TP), and their partial outputs sum to the
single-rank layer; through the engine on gloo, EP size 2 gives the tokens
(and logits within 1e-3) of size 1 and of TP size 2; an EP size that does
not divide the experts is refused; the load-balance counters add up to the
tokens computed times top_k."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_model
from tp_helpers import LogitRecorder, max_logit_diff, tp_prompts

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers import parallel_state
from shoal.workers.model_executor.layers.fused_moe.layer import W1, W2, W3, FusedMoE
from shoal.workers.model_executor.loader.dummy_weights import dummy_weight_shapes, dummy_weights
from shoal.workers.model_executor.loader.model_loader import build_model, load_model_files
from shoal.workers.model_executor.memory.memory_profiler import estimate_weight_bytes

E, K, H, INTER = 8, 2, 64, 32
ENGINE = dict(dtype="float32", num_kv_blocks=24, block_size=8, max_num_batched_tokens=48, max_num_seqs=6, num_threads=1)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return {
        "qwen3_moe": make_tiny_model(str(tmp_path_factory.mktemp("ep-qwen3-moe")), "qwen3_moe"),
        "mixtral": make_tiny_model(str(tmp_path_factory.mktemp("ep-mixtral")), "mixtral"),
        # layer 0 dense (mlp_only_layers), 1 and 2 sparse
        "qwen3_moe-dense-first": make_tiny_model(
            str(tmp_path_factory.mktemp("ep-qwen3-moe-dense")),
            "qwen3_moe",
            mlp_only_layers=[0],
            num_hidden_layers=3,
            norm_topk_prob=False,
        ),
    }


def _expert_weights(seed: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {W1: (INTER, H), W3: (INTER, H), W2: (H, INTER)}
    return {(e, w): torch.randn(shapes[w], generator=g) * 0.2 for e in range(E) for w in shapes}


def _layer(monkeypatch, rank: int, size: int, ep: bool, weights, renormalize: bool = True) -> FusedMoE:
    """One rank's layer, built as in its own process; its all-reduce left out (the test sums the ranks)."""
    monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup(rank, size, expert_parallel=ep))
    layer = FusedMoE(E, K, H, INTER, renormalize)
    monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup())
    layer.tp = parallel_state.TPGroup()
    for (e, w), t in weights.items():
        layer.weight_loader(layer.w2_weight if w == W2 else layer.w13_weight, t, (e, w))
    return layer


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_ranks_partial_outputs_sum_to_the_single_rank_layer(monkeypatch, size, ep):
    weights = _expert_weights()
    whole = _layer(monkeypatch, 0, 1, False, weights)
    ranks = [_layer(monkeypatch, r, size, ep, weights) for r in range(size)]
    if ep:  # whole experts, contiguous ids, the others mapped to -1
        assert [r.w13_weight.shape for r in ranks] == [torch.Size([E // size, 2 * INTER, H])] * size
        assert ranks[1].expert_map.tolist() == [-1] * (E // size) + list(range(E // size)) + [-1] * (E - 2 * E // size)
    else:
        assert [r.w2_weight.shape for r in ranks] == [torch.Size([E, H, INTER // size])] * size
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(37, E, generator=torch.Generator().manual_seed(2))
    want = whole(x, logits)
    got = sum(r(x, logits) for r in ranks)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    # Every rank routes every token alike: its counters are the whole layer's.
    assert all(torch.equal(r.expert_load(), whole.expert_load()) for r in ranks)
    assert int(whole.expert_load().sum()) == 37 * K
    if ep:
        assert ranks[0].rank_load().tolist() == whole.expert_load().view(size, -1).sum(1).tolist()


def test_stacked_layout_loads_as_the_per_expert_one(monkeypatch):
    """transformers 5's in-memory layout ([E, 2I, H] gate rows then up rows; [E, H, I])."""
    weights = _expert_weights()
    for ep in (False, True):
        per_expert = _layer(monkeypatch, 1, 2, ep, weights)
        stacked = _layer(monkeypatch, 1, 2, ep, {})
        w13 = torch.stack([torch.cat([weights[(e, W1)], weights[(e, W3)]]) for e in range(E)])
        w2 = torch.stack([weights[(e, W2)] for e in range(E)])
        stacked.weight_loader(stacked.w13_weight, w13, None)
        stacked.weight_loader(stacked.w2_weight, w2, None)
        assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
        assert torch.equal(stacked.w2_weight, per_expert.w2_weight)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(tmp_path, monkeypatch):
    path = make_tiny_model(str(tmp_path / "m"), "qwen3_moe", num_experts=6)
    cfg = load_model_files(path).config
    cfg.check_tp_size(4)  # tensor parallel: 4 divides the expert width 32
    with pytest.raises(ValueError, match="expert-parallel size 4 does not divide the model's 6 experts"):
        cfg.check_tp_size(4, expert_parallel=True)
    # The engine refuses before any rank starts (no Ray here).
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        LLM(path, tensor_parallel_size=4, enable_expert_parallel=True, num_threads=1)
    monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup(0, 4, expert_parallel=True))
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        FusedMoE(6, 2, H, INTER, True)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen3_moe-dense-first"])
def test_load_counters_add_up_to_tokens_times_top_k(moe_models, kind):
    prompts = tp_prompts(500, n=6)
    max_tokens = 5
    with LLM(moe_models[kind], dtype="float32", num_kv_blocks=128, enable_prefix_caching=False, num_threads=1) as llm:
        model = llm.engine.runner.model
        model.reset_expert_load()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        load = model.expert_load()
        assert llm.engine.stats().num_preemptions == 0
    computed = sum(len(p) + max_tokens - 1 for p in prompts)  # the last token is sampled, never fed back
    assert load.shape == (2, 8)
    assert load.sum(dim=1).tolist() == [computed * 2] * 2
    assert (load > 0).sum() > 8  # routing spreads (not one expert per layer)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen3_moe-dense-first"])
@pytest.mark.parametrize("tp", [1, 2])
def test_estimate_equals_each_ranks_parameters(monkeypatch, moe_models, kind, tp):
    cfg = load_model_files(moe_models[kind]).config
    for ep in (False, True):
        for rank in range(tp):
            monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup(rank, tp, expert_parallel=ep))
            model = build_model(cfg, dummy_weights(cfg, torch.device("cpu")), 64, torch.device("cpu"), torch.float32)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            assert estimate_weight_bytes(cfg, torch.float32, tp, ep) == params, (ep, rank)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _run(model: str, tp: int, ep: bool, prompts, max_tokens: int):
    """Greedy tokens, each step's logits, rank 0's load counters and experts held."""
    with LLM(model, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE) as llm:
        m = llm.engine.runner.model
        rec = llm.engine.runner.sampler = LogitRecorder(llm.engine.runner.sampler)
        m.reset_expert_load()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        held = m.moe_layers()[0].w13_weight.shape
        return [o.token_ids for o in outs], rec.steps, m.expert_load(), m.rank_load(), held


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_expert_parallel_2_equals_1_and_tensor_parallel_2(ray_cluster, moe_models, kind):
    prompts, n = tp_prompts(500, n=10), 16
    one, one_logits, one_load, _, one_held = _run(moe_models[kind], 1, False, prompts, n)
    ep, ep_logits, ep_load, ep_ranks, ep_held = _run(moe_models[kind], 2, True, prompts, n)
    tp, tp_logits, tp_load, _, tp_held = _run(moe_models[kind], 2, False, prompts, n)
    assert (one_held, ep_held, tp_held) == ((8, 64, 64), (4, 64, 64), (8, 32, 64))
    assert ep == one and tp == one
    diff_ep, diff_tp = max_logit_diff(one_logits, ep_logits), max_logit_diff(one_logits, tp_logits)
    print(f"\n{kind}: EP=2 vs 1 largest logit difference {diff_ep:.2e}, TP=2 vs 1 {diff_tp:.2e}")
    assert diff_ep < 1e-3 and diff_tp < 1e-3
    # The same steps route alike, and each EP rank's share is its experts' picks.
    assert torch.equal(ep_load, one_load) and torch.equal(tp_load, one_load)
    assert torch.equal(ep_ranks, one_load.view(2, 2, 4).sum(-1))


def test_bench_offline_runs_a_moe_config_with_its_peer_and_prints_the_load(moe_models, tmp_path, capsys, monkeypatch):
    """--load-format dummy on a folder with config.json alone: shoal's random weights, and transformers'
    continuous batching on a random model of the same config; the routing's balance is printed and kept."""
    import shutil

    from shoal.benchmarks import offline
    from shoal.cluster.cli import main

    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{moe_models['mixtral']}/{name}", folder / name)
    # the machine's rates are not what this checks
    monkeypatch.setattr(
        offline, "measure_gemms", lambda threads, int8: {"float32": {"ops_s": 1e11, "wall_ops_s": 1e11}}
    )
    monkeypatch.setattr(offline, "measure_rooflines", lambda threads, achieved: {})
    out = tmp_path / "offline.json"
    flags = ["--model", str(folder), "--load-format", "dummy", "--workload", "short", "--num-prompts", "4"]
    flags += ["--peers", "cb", "--num-threads", "1", "--kv-cache-memory-bytes", str(64 << 20), "--output", str(out)]
    assert main(["bench", "offline", *flags]) == 0
    rep = json.loads(out.read_text())["workloads"]["short"]
    shoal = rep["results"]["shoal"]
    assert offline.CB in rep["results"]
    layers = shoal["expert_load"]
    assert len(layers) == 2 and len({sum(row) for row in layers}) == 1  # each layer: the same tokens x top_k
    assert shoal["rank_load"] == [[sum(row)] for row in layers]
    # 2 of 8 experts a token: the roofline counts the active parameters
    assert rep["params"] == shoal["active_params"] < shoal["params"]
    assert "expert load over 2 sparse layers" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen3_moe-dense-first"])
def test_checkpoint_shapes_are_what_transformers_saves(moe_models, kind):
    """--load-format dummy's names and shapes: the per-expert layout of the Hub's checkpoints."""
    from safetensors import safe_open

    path = moe_models[kind]
    cfg = load_model_files(path).config
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert dict(dummy_weight_shapes(cfg)) == saved
