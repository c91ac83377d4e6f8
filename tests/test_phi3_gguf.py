"""Phi-3 from a GGUF file: a tiny random Phi-3 written as llama.cpp's
convert_hf_to_gguf writes it (fused attn_qkv and ffn_up, rope.dimension_count
for partial rotary, LongRoPE as two factor tensors), in float32, must give
transformers' greedy tokens for the Hugging Face checkpoint it came from.
And the dummy weights' names and shapes are the checkpoint's."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from reference import check_tokens, hf_greedy
from tiny_gguf import add_tiny_tokenizer
from tiny_models import make_tiny_model

from shoal.proto.gguf_file import GGUFFile
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.models.config import ModelConfig

gguf = pytest.importorskip("gguf")

SHORT = [1.0, 1.2, 1.7, 2.5, 4.0, 6.0]  # 6 factors: 3/4 of a 16-dim head rotated
LONG = [1.5, 2.5, 4.0, 8.0, 16.0, 32.0]
ORIGINAL = 64


def _write_gguf(hf_dir: str, path: str, split_qkv: bool = False, factors: tuple[str, ...] = ("long", "short")) -> str:
    """The metadata and tensor names of convert_hf_to_gguf's Phi3MiniModel;
    split_qkv: q/k/v as three tensors (llama.cpp reads either)."""
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    rope = c["rope_parameters"]
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    w = gguf.GGUFWriter(path, "phi3")
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", c["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)

    add_tiny_tokenizer(w, hf_dir, c)

    sd = {k: v.float().numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    if rope["rope_type"] == "longrope":
        scale = c["max_position_embeddings"] / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        for which in factors:
            w.add_tensor(f"rope_factors_{which}.weight", np.asarray(rope[f"{which}_factor"], dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    q, kv = hidden, c["num_key_value_heads"] * hidden // heads
    for i in range(c["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        qkv = sd[p + "self_attn.qkv_proj.weight"]
        if split_qkv:
            for name, part in zip(("attn_q", "attn_k", "attn_v"), np.split(qkv, [q, q + kv])):
                w.add_tensor(f"{b}{name}.weight", np.ascontiguousarray(part))
        else:
            w.add_tensor(b + "attn_qkv.weight", qkv)
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory) -> dict[str, str]:
    """name -> Hugging Face folder."""
    return {
        # Phi-3-mini-4k's shape: a window on every layer, here half rotary
        "windowed": make_tiny_model(str(tmp_path_factory.mktemp("phi3-win")), "phi3", sliding_window=50),
        # Phi-4-mini's shape: 3/4 rotary, LongRoPE, no window
        "longrope": make_tiny_model(
            str(tmp_path_factory.mktemp("phi3-lr")),
            "phi3",
            partial_rotary_factor=0.75,
            original_max_position_embeddings=ORIGINAL,
            rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        ),
    }


def _prompts(lengths: list[int]) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _check(gguf_path: str, hf_dir: str, prompts, max_tokens: int, **engine) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = LLM(gguf_path, dtype="float32", quantization="none", num_kv_blocks=128, num_threads=1, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    refs = hf_greedy(hf, prompts, max_tokens, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize("name", ["windowed", "longrope"])
def test_gguf_config_equals_the_checkpoints(phi3_models, tmp_path, name):
    hf_dir = phi3_models[name]
    g = GGUFFile(_write_gguf(hf_dir, str(tmp_path / "m.gguf")))
    ours = ModelConfig.from_gguf_metadata(g.metadata, set(g.tensors))
    with open(os.path.join(hf_dir, "config.json")) as f:
        ref = ModelConfig.from_hf_dict(json.load(f))
    assert ours.architecture == "Phi3ForCausalLM"
    assert int(ours.head_dim * ours.partial_rotary_factor) == int(ref.head_dim * ref.partial_rotary_factor)
    assert ours.layer_sliding_windows == ref.layer_sliding_windows
    assert (ours.rope_scaling or {}).get("rope_type") == (ref.rope_scaling or {}).get("rope_type")


@pytest.mark.parametrize("split_qkv", [False, True], ids=["fused-qkv", "split-qkv"])
def test_windowed_partial_rotary_gguf_matches_transformers(phi3_models, tmp_path, split_qkv):
    hf_dir = phi3_models["windowed"]
    path = _write_gguf(hf_dir, str(tmp_path / "m.gguf"), split_qkv=split_qkv)
    _check(path, hf_dir, _prompts([3, 30, 120]), 12)  # 120: well past the window of 50


def test_longrope_gguf_within_the_original_context(phi3_models, tmp_path):
    """The short factors, from their tensor: max_model_len within the original context."""
    hf_dir = phi3_models["longrope"]
    _check(_write_gguf(hf_dir, str(tmp_path / "m.gguf")), hf_dir, _prompts([2, 25, 44]), 20, max_model_len=ORIGINAL)


def test_longrope_gguf_beyond_the_original_context(phi3_models, tmp_path):
    """The long factors (the engine serves up to 1024): prompts past the original context."""
    hf_dir = phi3_models["longrope"]
    _check(_write_gguf(hf_dir, str(tmp_path / "m.gguf")), hf_dir, _prompts([70, 160]), 12)


def test_dummy_weight_shapes_are_the_checkpoints(phi3_models):
    from safetensors import safe_open

    from shoal.workers.model_executor.loader.dummy_weights import dummy_weight_shapes
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    for path in phi3_models.values():
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert dict(dummy_weight_shapes(load_model_files(path).config)) == saved


def test_longrope_gguf_without_its_short_factors_is_refused(phi3_models, tmp_path):
    path = _write_gguf(phi3_models["longrope"], str(tmp_path / "m.gguf"), factors=("long",))
    with pytest.raises(ValueError, match="short_factor"):
        LLM(path, dtype="float32", num_kv_blocks=16, num_threads=1)
