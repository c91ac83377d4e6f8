"""Tiny random Llama-family models saved as Hugging Face folders (the same
loading path as a real checkpoint), with a small byte-level BPE tokenizer
trained on the spot."""

from __future__ import annotations

import json
import os

import torch

TINY_VOCAB = 512

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching rebuilds the batch at every step.",
    "Paged attention keeps keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.",
] * 20


def _train_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}",
            },
            f,
        )


def make_tiny_model(path: str, kind: str = "llama", **overrides) -> str:
    """Save a tiny random model of `kind` (llama, qwen2, mistral) to path."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    cls_cfg, cls_model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    args = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # wider than the default 0.02, so logits are spread and ties rare
        initializer_range=0.3,
    )
    args.update(overrides)
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**args)).to(torch.float32).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    _train_tokenizer(path)
    return path
