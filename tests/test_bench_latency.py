"""`shoal bench latency` end to end on the tiny model: its figures are
consistent with one another and its weight count with the model's."""

from __future__ import annotations

import json

import pytest

from shoal.benchmarks.latency import weight_bytes
from shoal.cluster.cli import main
from shoal.workers import LLM, LLMEngine


def test_bench_latency_reports_ttft_tpot_and_the_memory_floor(tiny_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                tiny_model,
                "--input-len",
                "16",
                "--output-len",
                "6",
                "--num-iters",
                "3",
                "--num-iters-warmup",
                "1",
                "--read-mib",
                "16",
                "--profile",
                "--profile-batch",
                "4",
                "--profile-prefill-len",
                "40",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] and 0 < r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"]
    assert r["read_bandwidth_gb_s"] > 0
    # The report holds the rate in GB/s: going back to bytes/s rounds differently in the last bit.
    assert r["memory_floor_ms"] == pytest.approx(r["weight_bytes"] / (r["read_bandwidth_gb_s"] * 1e9) * 1e3, rel=1e-12)
    assert abs(r["tpot_over_floor"] - r["tpot_ms"]["p50"] / r["memory_floor_ms"]) < 1e-9
    printed = capsys.readouterr().out
    assert "memory floor" in printed and "per-token time / floor" in printed
    # The profile's parts add up to its step, and the decode steps took the compiled layers.
    prof = r["profile"]
    assert abs(sum(prof["parts_ms"].values()) - prof["step_ms"]) < 1e-6 * prof["step_ms"] + 1e-9
    assert prof["parts_ms"]["decoder layers"] > 0 and "one compiled call" in printed
    # Each host-side part of the step is timed on its own, not lumped together.
    for part in (
        "sampler",
        "input staging (token ids, positions, slots, one copy)",
        "scheduler (schedule, update from output)",
        "detokenizer and output deltas",
    ):
        assert prof["parts_ms"][part] > 0, part
    # Inside the one call, every op of a layer is timed, in layer order, and
    # together they take no more than the call; each matrix's rate is its
    # bytes over its op's time.
    ops = prof["decoder_ops_ms"]
    assert list(ops) == [
        "input norm",
        "qkv_proj",
        "RoPE and KV write",
        "attention",
        "o_proj",
        "post-attention norm",
        "gate_up_proj",
        "SiLU and mul",
        "down_proj",
    ]
    assert all(ms > 0 for ms in ops.values()) and sum(ops.values()) <= prof["parts_ms"]["decoder layers"]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        m = prof["matrices"][name]
        assert m["ms"] == ops[name] and abs(m["gb_s"] - m["bytes"] / m["ms"] / 1e6) < 1e-9
    assert prof["matrices"]["lm_head"]["ms"] == prof["parts_ms"]["LM head"]
    assert set(prof["matrices"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    # The step table by part: one stream, a batch decoding, and the batch beside a prompt's prefill;
    # each adds up to its step, the float32 matrices and both kinds of attention timed where they ran.
    one, batched, mixed = r["step_profile"]
    assert [p["label"] for p in (one, batched, mixed)] == [
        "one stream, decode steps",
        "4 sequences decoding",
        "4 sequences decoding + a 40-token prompt",
    ]
    for p in (one, batched, mixed):
        parts = p["parts_ms"]
        assert abs(sum(parts.values()) - p["step_ms"]) < 1e-6 * p["step_ms"] + 1e-9, p["label"]
        assert parts["linear, float32"] > 0 and parts["attention (decode)"] > 0, p["label"]
        assert parts["input preparation (staging, attention metadata)"] > 0 and parts["sampler"] > 0
    assert one["parts_ms"]["attention (prefill)"] == batched["parts_ms"]["attention (prefill)"] == 0
    assert mixed["parts_ms"]["attention (prefill)"] > 0
    assert "each part's share of a step" in printed
    # Every parameter counted once: the tiny model's embedding and LM head are separate tensors.
    model = LLMEngine(model=tiny_model, num_kv_blocks=16).runner.model
    params = {id(p): p for p in model.parameters()}
    assert r["weight_bytes"] == weight_bytes(model) == sum(p.numel() * p.element_size() for p in params.values())


def test_bench_latency_profiles_a_mixture_of_experts(tmp_path, capsys):
    """An MoE model's profile reads the experts a step picked: their bytes per
    step are the picked experts' matrices, and the floor counts top-k experts."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe")
    out = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", path, "--input-len", "16", "--output-len", "6", "--num-iters", "2"]
    assert main([*args, "--num-iters-warmup", "1", "--read-mib", "16", "--profile", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    experts = r["profile"]["experts"]
    model = LLM(path, num_threads=1).engine.runner.model
    layers = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    one_expert = sum(w[0].numel() * w.element_size() for w in (layers[0].w13_weight, layers[0].w2_weight))
    # Batch 1: each layer's step reads at most top_k experts, at least one.
    k = layers[0].top_k
    assert len(layers) * one_expert <= experts["mb_per_step"] * 1e6 <= len(layers) * k * one_expert
    # The floor's bytes leave out each layer's unpicked experts.
    every_param = sum(p.numel() * p.element_size() for p in model.parameters())
    unread = sum(m.w13_weight.shape[0] - k for m in layers) * one_expert
    assert r["weight_bytes"] == weight_bytes(model) == every_param - unread
    assert experts["gb_s"] > 0 and experts["dense_gb_s"] > 0
    assert "the experts read at" in capsys.readouterr().out
