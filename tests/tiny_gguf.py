"""Writing tiny GGUF files in llama.cpp's layout from the tiny models of
tiny_models.py: the tokenizer part every architecture's file shares."""

from __future__ import annotations

import json
import os

# Hugging Face block pieces -> llama.cpp's, for the attention every architecture here shares (written
# from llama.cpp's names, not from shoal's own table, so the tests check that table).
ATTENTION_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def add_tiny_tokenizer(w, hf_dir: str, cfg: dict) -> None:
    """The folder's byte-level BPE tokenizer as GGUF's gpt2 vocabulary on
    GGUFWriter `w` (ids past the trained vocabulary padded, the first three
    marked as control tokens), with the config's bos and eos."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)["model"]
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    for t, i in tok["vocab"].items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
