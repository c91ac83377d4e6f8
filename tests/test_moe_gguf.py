"""Mixture-of-experts GGUF files: a tiny random Qwen3-MoE and Mixtral, each
written in float32 as llama.cpp's converter lays them out (qwen3moe; Mixtral
as a "llama" with experts, q/k permuted; each projection of every expert
stacked in one 3-D tensor), give transformers' greedy tokens on the
Hugging Face folder they came from."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from reference import check_tokens, hf_greedy
from tiny_gguf import ATTENTION_NAMES, add_shape, add_tiny_tokenizer
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.loader.model_loader import load_model_files

PROMPTS = [[5, 17, 99, 200, 3, 44, 87], [300, 12, 9], list(range(3, 70))]
MAX_NEW = 12
# kind -> (general.architecture, checkpoint name of the sparse block, of gate / up / down)
LAYOUTS = {
    "qwen3_moe": ("qwen3moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("llama", "block_sparse_moe", ("w1", "w3", "w2")),
}
BLOCK_NAMES = {**ATTENTION_NAMES, "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (convert_hf_to_gguf's permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: str, kind: str, path: str) -> None:
    import gguf
    from safetensors.torch import load_file

    arch, block, pieces = LAYOUTS[kind]
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    sd = {k: v.numpy() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    w = gguf.GGUFWriter(path, arch)
    n_experts = c.get("num_experts") or c["num_local_experts"]
    add_shape(w, c)
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if "moe_intermediate_size" in c:
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    add_tiny_tokenizer(w, folder, c)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, name in BLOCK_NAMES.items():
            t = sd.get(f"{p}{hf}.weight")
            if t is None:
                continue
            if arch == "llama" and name in ("attn_q", "attn_k"):
                t = _permute(t, c["num_attention_heads" if name == "attn_q" else "num_key_value_heads"])
            w.add_tensor(f"blk.{i}.{name}.weight", t)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}{block}.gate.weight"])
        for piece, name in zip(pieces, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            stacked = np.stack([sd[f"{p}{block}.experts.{e}.{piece}.weight"] for e in range(n_experts)])
            w.add_tensor(f"blk.{i}.{name}.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_moe_gguf_matches_the_folder_it_came_from(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    # Qwen3-MoE as llama.cpp runs it: every layer sparse, top-k renormalised.
    folder = make_tiny_model(str(tmp_path / "hf"), kind)
    path = str(tmp_path / f"{kind}.gguf")
    write_gguf(folder, kind, path)

    loaded = load_model_files(path)
    want = load_model_files(folder).config
    got = loaded.config
    assert got.architecture == want.architecture
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim"):
        assert getattr(got, field) == getattr(want, field), field
    names = {name for name, _ in loaded.weights}
    assert f"model.layers.1.{LAYOUTS[kind][1]}.experts.7.{LAYOUTS[kind][2][2]}.weight" in names

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with LLM(path, dtype="float32", quantization="none", num_kv_blocks=64, block_size=8, num_threads=1) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
        eos = llm.engine.eos_token_ids
    refs = hf_greedy(hf, PROMPTS, MAX_NEW, eos)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(PROMPTS, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes
