"""The KV cache's share of the GPU (memory_profiler.py): the arithmetic on
made-up figures, the refusal messages, and the weight estimate against
models the project really builds."""

from __future__ import annotations

import re

import pytest
import torch

from shoal.workers.model_executor.layers import parallel_state
from shoal.workers.model_executor.loader.dummy_weights import dummy_weights
from shoal.workers.model_executor.loader.model_loader import build_model, load_model_files
from shoal.workers.model_executor.memory import memory_profiler as mp
from shoal.workers.model_executor.models.config import ModelConfig

GiB = 1 << 30
KNOBS = ("--gpu-memory-utilization", "--max-model-len", "--max-num-batched-tokens", "--tensor-parallel-size", "--dtype")


def profile(total=80, weights=16, activation=2, non_torch=1) -> mp.MemoryProfile:
    return mp.MemoryProfile(total * GiB, weights * GiB, activation * GiB, non_torch * GiB)


def test_kv_cache_bytes_is_the_budget_less_weights_activation_peak_and_non_torch():
    p = profile(total=80, weights=16, activation=2, non_torch=1)
    assert p.kv_cache_bytes(0.9) == int(80 * GiB * 0.9) - 19 * GiB  # 72 - 19 = 53 GiB
    assert p.kv_cache_bytes(1.0) == 61 * GiB
    assert profile(total=80, weights=70).kv_cache_bytes(0.9) == int(72 * GiB) - 73 * GiB < 0


def test_describe_gives_every_figure_in_gib_on_one_line():
    line = profile(total=80, weights=16, activation=2, non_torch=1).describe()
    assert "\n" not in line
    for figure in ("total 80.00 GiB", "weights 16.00 GiB", "activation peak 2.00 GiB", "non-torch 1.00 GiB"):
        assert figure in line
    assert "KV cache 53.00 GiB at gpu_memory_utilization 0.9" in profile().describe(0.9)


def test_profile_from_snapshots_counts_the_peak_over_the_weights_and_memory_torch_did_not_reserve():
    # Before: 20 GiB weights allocated, 21 reserved, 22 used on the card -> 1 GiB non-torch.
    before = mp.MemorySnapshot(free=58 * GiB, total=80 * GiB, allocated=20 * GiB, reserved=21 * GiB)
    # After: the forward loaded kernels and handles: 25 used, 22 reserved -> 3 GiB non-torch.
    after = mp.MemorySnapshot(free=55 * GiB, total=80 * GiB, allocated=20 * GiB, reserved=22 * GiB)
    p = mp.profile_from_snapshots(before, after, peak_allocated=24 * GiB)
    assert p == mp.MemoryProfile(80 * GiB, 20 * GiB, 4 * GiB, 3 * GiB)
    # Non-torch never goes below zero, nor does the activation peak.
    quiet = mp.MemorySnapshot(free=60 * GiB, total=80 * GiB, allocated=20 * GiB, reserved=21 * GiB)
    assert mp.profile_from_snapshots(quiet, quiet, peak_allocated=20 * GiB).non_torch_bytes == 0
    assert mp.profile_from_snapshots(quiet, quiet, peak_allocated=20 * GiB).activation_peak_bytes == 0


def test_plan_kv_cache_blocks_counts_the_blocks_that_fit():
    p = profile(total=80, weights=16, activation=2, non_torch=1)  # 53 GiB for the KV cache at 0.9
    assert mp.plan_kv_cache_blocks(p, 0.9, bytes_per_block=2 << 20, min_blocks=1) == 53 * 512
    assert mp.plan_kv_cache_blocks(p, 0.9, bytes_per_block=3 << 20, min_blocks=53 * 341) == 53 * 1024 // 3


def test_plan_refuses_too_few_blocks_with_every_figure_and_the_knobs():
    # 80 x 0.5 = 40 GiB; 40 - 30 - 6 - 3 = 1 GiB left; one sequence needs 2 GiB (1024 blocks of 2 MiB).
    p = profile(total=80, weights=30, activation=6, non_torch=3)
    with pytest.raises(mp.InsufficientMemoryError) as e:
        mp.plan_kv_cache_blocks(p, 0.5, bytes_per_block=2 << 20, min_blocks=1024)
    msg = str(e.value)
    for figure in (
        "80.00 GiB",
        "gpu_memory_utilization 0.5",
        "40.00 GiB",
        "weights 30.00 GiB",
        "activation peak 6.00 GiB",
        "non-torch memory 3.00 GiB",
        "leaves 1.00 GiB",
        "needs 1024 blocks (2.00 GiB",
        "512 fit",
    ):
        assert figure in msg, figure
    for knob in KNOBS:
        assert knob in msg, knob
    assert isinstance(e.value, RuntimeError)


def test_plan_refuses_when_the_rest_exceed_the_budget():
    p = profile(total=24, weights=20, activation=2, non_torch=1)  # 21.6 - 23 < 0
    with pytest.raises(mp.InsufficientMemoryError, match=r"and 0 fit\..* leaves -1\.40 GiB for the KV cache"):
        mp.plan_kv_cache_blocks(p, 0.9, bytes_per_block=1 << 20, min_blocks=1)


def test_plan_rejects_nonsense_block_figures():
    with pytest.raises(ValueError):
        mp.plan_kv_cache_blocks(profile(), 0.9, bytes_per_block=0, min_blocks=1)
    with pytest.raises(ValueError):
        mp.plan_kv_cache_blocks(profile(), 0.9, bytes_per_block=1024, min_blocks=0)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2, float("nan"), float("inf"), True, "0.9", None])
def test_utilization_outside_zero_one_is_refused_naming_the_knob(bad):
    for call in (
        lambda: profile().kv_cache_bytes(bad),
        lambda: mp.plan_kv_cache_blocks(profile(), bad, 1024, 1),
        lambda: mp.check_weights_fit(GiB, 80 * GiB, bad),
    ):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            call()


@pytest.mark.parametrize("good", [1e-3, 0.5, 0.9, 1, 1.0])
def test_utilization_inside_zero_one_is_taken(good):
    assert mp.check_utilization(good) == good
    assert profile(total=80, weights=0, activation=0, non_torch=0).kv_cache_bytes(good) == int(80 * GiB * good)


def llama3_70b() -> ModelConfig:
    return ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        )
    )


def test_estimate_matches_llama3_70b_published_parameter_count():
    assert mp.estimate_weight_bytes(llama3_70b(), torch.bfloat16) == 2 * 70_553_706_496


def test_a_70b_model_on_one_80_gib_card_is_refused_before_loading_and_fits_across_two():
    weights = mp.estimate_weight_bytes(llama3_70b(), torch.bfloat16)
    with pytest.raises(mp.InsufficientMemoryError) as e:
        mp.check_weights_fit(weights, 80 * GiB, 0.9)
    msg = str(e.value)
    for figure in ("131.42 GiB", "80.00 GiB", "gpu_memory_utilization 0.9", "72.00 GiB", *KNOBS):
        assert figure in msg, figure
    half = mp.estimate_weight_bytes(llama3_70b(), torch.bfloat16, tp_size=2)
    assert abs(half - weights / 2) < 0.01 * weights  # the norms stay whole on each rank
    mp.check_weights_fit(half, 80 * GiB, 0.9)  # 65.7 GiB of 72: no error
    mp.check_weights_fit(72 * GiB, 80 * GiB, 0.9)  # exactly the budget fits


def test_a_70b_fp8_checkpoint_fits_one_80_gib_card_where_its_bfloat16_form_does_not():
    """A checkpoint stored in fp8 (llm-compressor's FP8_DYNAMIC) is counted at one byte a
    linear weight; the embedding and the LM head stay bfloat16 (test_compressed_tensors.py
    checks the estimate against a built model)."""
    from shoal.workers.model_executor.layers.quantization.compressed_tensors import CompressedTensorsConfig

    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    }
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
    fp8 = CompressedTensorsConfig.from_config(qc).linear_weight_bytes(torch.bfloat16)
    weights = mp.estimate_weight_bytes(llama3_70b(), torch.bfloat16, linear_bytes=fp8)
    assert 67 * GiB < weights < 68 * GiB  # 68.5e9 matrix weights at 1 byte, 2.1e9 embedding and head at 2
    mp.check_weights_fit(weights, 80 * GiB, 0.9)  # no error: 72 GiB of budget
    with pytest.raises(mp.InsufficientMemoryError):
        mp.check_weights_fit(mp.estimate_weight_bytes(llama3_70b(), torch.bfloat16), 80 * GiB, 0.9)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight is listed once


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "llama-tied-bias", "qwen2-bias-mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_equals_the_parameters_of_a_built_checkpoint(tiny_models, variant, dtype):
    loaded = load_model_files(tiny_models[variant])
    model = build_model(loaded.config, loaded.weights, 64, torch.device("cpu"), dtype)
    assert mp.estimate_weight_bytes(loaded.config, dtype) == param_bytes(model)


def tiny_config(**overrides) -> ModelConfig:
    d = dict(
        model_type="llama",
        vocab_size=509,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    d.update(overrides)
    return ModelConfig(**d)


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 > 2 KV heads: each rank holds one replicated KV head
@pytest.mark.parametrize(
    "shape", [{}, {"tie_word_embeddings": True}, {"qkv_bias": True, "o_bias": True, "mlp_bias": True}]
)
def test_estimate_equals_each_tensor_parallel_ranks_parameters(monkeypatch, tp, shape):
    """Each rank builds its slice (the parallel layers read the group when
    built; loading slices the full tensors, no collective runs), vocab 509
    leaving the last rank padded rows."""
    cfg = tiny_config(**shape)
    cfg.check_tp_size(tp)
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup(rank, tp))
        model = build_model(cfg, dummy_weights(cfg, torch.device("cpu")), 64, torch.device("cpu"), torch.float32)
        assert mp.estimate_weight_bytes(cfg, torch.float32, tp) == param_bytes(model), (tp, rank)


def test_profile_memory_refuses_a_device_other_than_cuda():
    called = []
    for device in ("cpu", torch.device("cpu"), "meta"):
        with pytest.raises(ValueError, match="CUDA"):
            mp.profile_memory(device, lambda: called.append(1))
    assert called == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a real GPU")
def test_profile_memory_on_cuda_sees_weights_and_the_forward_peak():
    device = torch.device("cuda")
    weights = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # held through the profile

    def forward():
        scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        scratch.fill_(1)

    p = mp.profile_memory(device, forward)
    assert p.total_bytes == torch.cuda.mem_get_info(device)[1]
    assert p.weights_bytes >= weights.numel()
    assert 256 << 20 <= p.activation_peak_bytes < 260 << 20
    assert p.non_torch_bytes > 0  # at least the CUDA context
    assert re.search(r"total \d+\.\d\d GiB", p.describe())
