"""The registry and the loader around it: which checkpoints are refused and
how, sharded safetensors folders, and every architecture building from its
config alone (--load-format dummy)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from reference import hf_greedy
from tiny_models import KINDS, make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.loader.model_loader import load_model_files
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    cfg = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model_files(str(tmp_path))
    assert "GPTNeoXForCausalLM" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_a_config_without_architectures_is_found_by_its_model_type():
    base = dict(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    assert ModelConfig.from_hf_dict(base | {"model_type": "qwen3"}).architecture == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="model_type 'bert'"):
        ModelConfig.from_hf_dict(base | {"model_type": "bert"})


def test_an_unknown_gguf_architecture_is_refused():
    md = {"general.architecture": "rwkv7", "rwkv7.attention.head_count": 1}
    with pytest.raises(ValueError, match="GGUF architecture 'rwkv7' is not supported"):
        ModelConfig.from_gguf_metadata(md, set())


def test_every_registered_architecture_has_its_class():
    for arch in SUPPORTED_ARCHITECTURES:
        assert get_model_class(arch).__name__ in (arch, "LlamaForCausalLM")


def test_a_sharded_folder_loads_through_its_index(tmp_path):
    """save_pretrained with a small shard size writes several files and an
    index; a stray safetensors file the index does not name is not read."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(str(tmp_path / "whole"))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(src, f), os.path.join(sharded, f))
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    torch.save({}, os.path.join(sharded, "stray.bin"))
    from safetensors.torch import save_file

    save_file({"junk.weight": torch.zeros(2)}, os.path.join(sharded, "consolidated.safetensors"))
    prompts = [[5, 6, 7, 8, 9, 10]]
    out = LLM(sharded, dtype="float32", num_kv_blocks=64).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert out[0].token_ids == hf_greedy(hf.eval(), prompts, 8, [2])[0]


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("llama", "qwen2", "mistral")])
def test_every_architecture_builds_from_its_config_alone(tmp_path, kind):
    """--load-format dummy: the folder holds config.json and a tokenizer, no weights."""
    path = make_tiny_model(str(tmp_path / kind), kind)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    llm = LLM(path, dtype="float32", load_format="dummy", num_kv_blocks=64)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
