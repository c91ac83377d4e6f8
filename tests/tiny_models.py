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


# kind -> (transformers config class, model class, what the kind changes from
# the shared tiny shape below). An architecture's tests add its kind here.
KINDS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    # head_dim 16 (Qwen3's default is 128); q/k norms with random weights, so they matter
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    # fused q/k/v and gate/up; half of each 16-dim head rotated; Phi3Config's pad id 32000 is outside the vocab
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "pad_token_id": None}),
    # 8 experts of width 32, top 2, renormalised (Qwen3-30B-A3B's norm_topk_prob; transformers' default is off)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    # intermediate_size is Mixtral's expert width
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    ),
    # local layers (window 24, so long prompts drop tokens) around a global one, each with its
    # own rotary base; q.k scaled by a query_pre_attn_scalar unlike head_dim
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        },
    ),
}


def make_tiny_model(path: str, kind: str = "llama", **overrides) -> str:
    """Save a tiny random model of `kind` (a key of KINDS) to path."""
    import transformers

    cfg_name, model_name, kind_args = KINDS[kind]
    cls_cfg, cls_model = getattr(transformers, cfg_name), getattr(transformers, model_name)
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
    args.update(kind_args)
    args.update(overrides)
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**args)).to(torch.float32).eval()
    if kind not in ("llama", "qwen2", "mistral"):  # their tests predate this and keep their models
        _randomize_norms(model)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    _train_tokenizer(path)
    return path


def _randomize_norms(model) -> None:
    """Norm weights start as ones (or zeros in Gemma's 1 + w form), which
    would hide a norm loaded into the wrong place: draw them near their start."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen))
