"""load_format "dummy": random weights from a config alone, loaded through
the same load_weights path (and check) as a checkpoint's."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from shoal.proto.gguf_file import GGUFFile
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.loader.dummy_weights import HIGH, LOW, dummy_weight_shapes, dummy_weights
from shoal.workers.model_executor.loader.model_loader import build_model, load_model_files, model_weights
from shoal.workers.model_executor.models.config import ModelConfig

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory, tiny_model) -> str:
    """The tiny Llama's folder without its .safetensors."""
    path = tmp_path_factory.mktemp("config-only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model, name), path)
    return str(path)


def test_a_config_only_folder_generates_and_two_engines_agree(config_only):
    prompts = ["The quick brown fox", [5, 6, 7, 8]]
    engine = dict(load_format="dummy", num_kv_blocks=32)
    with LLM(config_only, **engine) as one, LLM(config_only, **engine) as two:
        assert one.engine.tokenizer is not None  # the folder's, though it has no weights
        outs = [o.token_ids for o in one.generate(prompts, GREEDY)]
        assert outs == [o.token_ids for o in two.generate(prompts, GREEDY)]
    assert all(len(t) == GREEDY.max_tokens for t in outs)


def test_auto_still_wants_the_weights(config_only):
    with pytest.raises(FileNotFoundError, match="holds no .safetensors weights"):
        LLM(config_only)


@pytest.mark.parametrize(
    "variant",
    [
        dict(model_type="llama", tie_word_embeddings=False),
        dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        dict(model_type="qwen2", tie_word_embeddings=True),
        dict(model_type="qwen2", tie_word_embeddings=False),
        dict(model_type="mistral", head_dim=32),
    ],
)
def test_every_parameter_is_loaded(variant):
    cfg = ModelConfig.from_hf_dict({**TINY, **variant})
    # load_weights raises on a parameter left without a tensor
    model = build_model(cfg, dummy_weights(cfg, CPU), 64, CPU, torch.float32)
    drawn = dict(dummy_weights(cfg, CPU))  # the same numbers again: one seed
    attn = model.layers[1].self_attn.qkv_proj
    parts = [drawn[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(attn.weight, torch.cat(parts))
    assert (attn.bias is not None) == (cfg.model_type == "qwen2" or "attention_bias" in variant)
    head = drawn["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    assert torch.equal(model.lm_head.weight, head)


def test_names_and_shapes_are_the_checkpoints(tiny_models):
    """Against real transformers checkpoints: untied, tied with biases, qwen2, mistral."""
    from safetensors import safe_open

    for path in tiny_models.values():
        cfg = load_model_files(path).config
        with safe_open(glob.glob(os.path.join(path, "*.safetensors"))[0], framework="pt") as f:
            saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert dict(dummy_weight_shapes(cfg)) == saved, path


def test_values_are_small_and_norms_are_ones():
    cfg = ModelConfig.from_hf_dict({**TINY, "model_type": "qwen2"})
    for name, t in dummy_weights(cfg, CPU):
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert LOW <= t.min() and t.max() <= HIGH and t.std() > 0.4 * HIGH, name  # spread over the range


def test_a_gguf_gives_the_config_and_no_tensor_is_read(monkeypatch):
    def no_read(self, name):
        raise AssertionError(f"read {name}")

    monkeypatch.setattr(GGUFFile, "load", no_read)
    loaded = load_model_files(None)  # SmolLM2-135M
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (576, 30, 49152)
    weights = model_weights(loaded, "dummy", torch.device("cpu"))
    assert [(n, tuple(t.shape)) for n, t in weights] == list(dummy_weight_shapes(cfg))
    assert loaded.tokenizer is not None


def test_an_unknown_load_format_is_refused(config_only):
    with pytest.raises(ValueError, match="load_format must be auto or dummy; got 'dumy'"):
        model_weights(load_model_files(config_only), "dumy", torch.device("cpu"))


def test_tensor_parallel_ranks_split_one_model(config_only):
    """Each rank draws the full tensors and keeps its slice: K = 2 is K = 1."""
    import ray

    prompts = [[5, 6, 7, 8], list(range(3, 40))]
    engine = dict(load_format="dummy", num_kv_blocks=32)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        with LLM(config_only, **engine) as one, LLM(config_only, tensor_parallel_size=2, **engine) as two:
            assert [o.token_ids for o in one.generate(prompts, GREEDY)] == [
                o.token_ids for o in two.generate(prompts, GREEDY)
            ]
    finally:
        ray.shutdown()
