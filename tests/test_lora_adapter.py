"""LoRA adapters in peft's format (workers/lora/peft_adapter.py), made by
peft in the test on a tiny random Llama: read with peft's tensors and
peft's scaling (lora_alpha / r, or / sqrt(r) under rsLoRA), and every
adapter shoal does not serve refused with the reason before it is kept."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from shoal.workers.lora import LoRARequest
from shoal.workers.lora.peft_adapter import LINEAR_MODULES, load_peft_adapter, module_shapes, peft_scaling
from shoal.workers.model_executor.loader.model_loader import load_model_files

peft = pytest.importorskip("peft")


def make_adapter(base: str, path: str, rank: int, seed: int, **config) -> str:
    """A peft LoRA adapter of `base` with random (not zero) A and B, saved to path."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = dict(r=rank, lora_alpha=2 * rank, target_modules=list(LINEAR_MODULES), init_lora_weights=False)
    cfg.update(config)
    peft.get_peft_model(model, peft.LoraConfig(**cfg)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("lora-base")))


@pytest.fixture(scope="module")
def config(base):
    return load_model_files(base).config


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("lora-adapters")
    return {
        "r4": make_adapter(base, str(d / "r4"), 4, 1),
        "r8-rslora": make_adapter(base, str(d / "r8"), 8, 2, use_rslora=True, lora_alpha=5),
        "r16-attn": make_adapter(base, str(d / "r16"), 16, 3, target_modules=["q_proj", "v_proj"]),
    }


def _peft_tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.parametrize("which,rank,modules", [("r4", 4, 7), ("r8-rslora", 8, 7), ("r16-attn", 16, 2)])
def test_an_adapter_is_read_as_peft_saved_it(adapters, config, which, rank, modules):
    path = adapters[which]
    adapter = load_peft_adapter(LoRARequest(which, 1, path), config, max_rank=16)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert adapter.rank == rank == cfg["r"]
    assert adapter.scaling == peft_scaling(cfg["lora_alpha"], rank, cfg.get("use_rslora", False))
    assert len(adapter.modules) == modules
    tensors = _peft_tensors(path)
    assert len(adapter.weights) == len(tensors) // 2 == modules * config.num_hidden_layers
    shapes = module_shapes(config)
    for (layer, module), (a, b) in adapter.weights.items():
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"base_model.model.model.layers.{layer}.{part}.{module}"
        assert torch.equal(a, tensors[f"{key}.lora_A.weight"].float())
        assert torch.equal(b, tensors[f"{key}.lora_B.weight"].float())
        assert (a.shape[1], b.shape[0]) == shapes[module]


def test_scaling_is_peft_own(base, adapters):
    """The scaling peft's LoraLayer computes for the same config."""
    import transformers

    for which in ("r4", "r8-rslora"):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        wrapped = peft.PeftModel.from_pretrained(model, adapters[which])
        q = wrapped.base_model.model.model.layers[0].self_attn.q_proj
        with open(os.path.join(adapters[which], "adapter_config.json")) as f:
            cfg = json.load(f)
        assert q.scaling["default"] == peft_scaling(cfg["lora_alpha"], cfg["r"], cfg.get("use_rslora", False))


def _edited(src: str, dst: str, config=None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        with open(os.path.join(dst, "adapter_config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        t = _peft_tensors(dst)
        tensors(t)
        save_file(t, os.path.join(dst, "adapter_model.safetensors"))
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


# (edit of adapter_config.json, edit of the tensors, the error it must raise)
BAD = [
    (lambda c: c.update(use_dora=True), None, "DoRA is not served"),
    (lambda c: c.update(bias="all"), None, "trained biases"),
    (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save"),
    (lambda c: c.update(rank_pattern={"q_proj": 2}), None, "per-module ranks"),
    (lambda c: c.update(r=0), None, "rank r must be a positive integer"),
    (lambda c: c.update(lora_alpha="big"), None, "lora_alpha must be a finite number"),
    (lambda c: c.update(peft_type="PREFIX_TUNING"), None, "peft_type 'PREFIX_TUNING' is not LORA"),
    (None, lambda t: t.update({Q_A: t[Q_A][:, :-1].contiguous()}), r"q_proj has A \(4, 63\)"),
    (None, lambda t: t.pop(Q_A), "layers.0.q_proj lacks its lora_A"),
    (None, lambda t: t.update({Q_A: torch.full_like(t[Q_A], float("nan"))}), "NaN or infinite"),
    (
        None,
        lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
        "the LM head and other modules are not served",
    ),
    (
        None,
        lambda t: t.update({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}),
        "layer 9 is beyond the base model's 2",
    ),
    (
        None,
        lambda t: t.update({"base_model.model.model.layers.0.mlp.act_fn.lora_A.weight": torch.zeros(4, 64)}),
        "target module 'act_fn' is not one of",
    ),
]


@pytest.mark.parametrize("edit_config,edit_tensors,match", BAD)
def test_a_bad_adapter_is_refused_with_the_reason(adapters, config, tmp_path, edit_config, edit_tensors, match):
    bad = _edited(adapters["r4"], str(tmp_path / "bad"), edit_config, edit_tensors)
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(LoRARequest("bad", 1, bad), config, max_rank=16)


def test_rank_above_the_limit_and_a_missing_folder_are_refused(adapters, config, tmp_path):
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        load_peft_adapter(LoRARequest("big", 1, adapters["r16-attn"]), config, max_rank=8)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_peft_adapter(LoRARequest("gone", 1, str(tmp_path / "nowhere")), config, max_rank=16)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json cannot be read"):
        load_peft_adapter(LoRARequest("broken", 1, str(tmp_path / "broken")), config, max_rank=16)


def test_a_request_for_another_base_model_is_refused(adapters, config):
    request = LoRARequest("r4", 1, adapters["r4"], base_model_name="some/other-model")
    with pytest.raises(ValueError, match="is for base model 'some/other-model', not 'tiny'"):
        load_peft_adapter(request, config, max_rank=16, base_model_name="tiny")
    assert load_peft_adapter(request, config, max_rank=16, base_model_name="some/other-model").rank == 4


@pytest.mark.parametrize("name,int_id", [("", 1), ("a", 0), ("a", -3), ("a", True), ("a", 1.5), ("x" * 300, 1)])
def test_a_bad_lora_request_is_refused(name, int_id):
    with pytest.raises(ValueError):
        LoRARequest(name, int_id, "/tmp")
