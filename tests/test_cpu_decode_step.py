"""The one-call CPU decode step reads the model's decode plan
(models/decode_plan.py, platforms/cpu/decode_step.py), never the model's
attributes: the Llama families plan their layers and take it, the others
offer no plan, and a model the step cannot run says why at start instead
of quietly running every decode layer by layer. A reshaped llama.py that
loses the fast path fails here, naming the reason."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
from tiny_gguf import write_llama_gguf
from tiny_models import KINDS, make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.models.decode_plan import LLAMA, DecodePlan
from shoal.workers.model_executor.models.llama import LlamaForCausalLM
from shoal.workers.model_executor.models.registry import get_model_class
from shoal.workers.model_executor.platforms.cpu.decode_step import CPUDecodeStep, decode_plan_of, why_not
from shoal.workers.model_executor.platforms.interface import DecodeStep

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

STEP_LOGGER = "shoal.workers.model_executor.platforms.cpu.decode_step"
# The families whose layers are Llama's own, which csrc/cpu_decode_layers.cpp computes.
ONE_CALL = ("llama", "qwen2", "mistral")


def _model(kind: str) -> torch.nn.Module:
    """A tiny model of `kind` (tiny_models.KINDS), its weights left as allocated: a plan reads modules only."""
    import transformers

    cfg_name, model_name, args = KINDS[kind]
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    hf = getattr(transformers, cfg_name)(vocab_size=256, num_key_value_heads=2, **{**shape, **args}).to_dict()
    cfg = ModelConfig.from_hf_dict({**hf, "architectures": [model_name]})
    return get_model_class(cfg.architecture)(cfg, 64)


def _modules(plan: DecodePlan) -> list[torch.nn.Module]:
    fields = [f.name for f in dataclasses.fields(plan.layers[0]) if f.name != "kind"]
    return [getattr(layer, f) for layer in plan.layers for f in fields] + [plan.embed_tokens, plan.norm, plan.lm_head]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_llama_families_plan_their_layers_and_the_others_none(kind):
    model = _model(kind)
    plan = decode_plan_of(model)
    reason = why_not(model, plan)
    if kind not in ONE_CALL:
        assert plan is None and reason == f"{type(model).__name__} offers no decode plan"
        return
    assert reason is None, f"{kind}'s decode steps no longer take the one-call CPU step: {reason}"
    assert [layer.kind for layer in plan.layers] == [LLAMA, LLAMA]
    own = {id(m) for m in model.modules()}
    assert all(id(m) in own for m in _modules(plan)), "the plan names modules the model does not hold"
    assert isinstance(CPUDecodeStep.create(model, object()), DecodeStep)  # any bound kernels will do here


def test_a_model_the_step_cannot_run_says_why(monkeypatch, caplog):
    model = _model("llama")
    kernels = object()  # stands for the bound extension; create() only checks that there is one
    plan = model.decode_plan()
    other = dataclasses.replace(plan, layers=tuple(dataclasses.replace(x, kind="qk_norm") for x in plan.layers))
    monkeypatch.setattr(model, "decode_plan", lambda: other)
    with caplog.at_level(logging.INFO, STEP_LOGGER):
        assert CPUDecodeStep.create(model, kernels) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING  # the model plans its layers: a refusal is news
    assert "layers of kind qk_norm; the C++ layers compute llama" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(model, "decode_plan", lambda: None)
    with caplog.at_level(logging.INFO, STEP_LOGGER):
        assert CPUDecodeStep.create(model, kernels) is None
    assert "LlamaForCausalLM offers no decode plan" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, STEP_LOGGER):
        assert CPUDecodeStep.create(model, None) is None  # kernels off: nothing to say
    assert caplog.records == []


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """A tiny Llama in Q8_0 blocks, as the default model's file holds its matrices."""
    d = tmp_path_factory.mktemp("plan-gguf")
    names = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return write_llama_gguf(make_tiny_model(str(d / "hf")), str(d / "q8_0.gguf"), dict.fromkeys(names, Q.Q8_0))


def _generate(llm: LLM) -> list[list[int]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 20)]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]


def test_the_engine_takes_the_step_over_a_gguf_llamas_plan(kernels, tiny_gguf, monkeypatch):
    with LLM(tiny_gguf, quantization="gguf", num_kv_blocks=64, enable_prefix_caching=False) as llm:
        step, model = llm.engine.runner.cpu_decode_step, llm.engine.runner.model
        assert isinstance(step, CPUDecodeStep), why_not(model, decode_plan_of(model))
        calls = []
        forward = step.forward
        monkeypatch.setattr(step, "forward", lambda *a: calls.append(1) or forward(*a))
        _generate(llm)
    assert len(calls) == 5  # every step after the prefills: decodes of the three rows, in one call each


def test_an_engine_whose_model_the_step_refuses_warns_and_runs_layer_by_layer(kernels, tiny_gguf, monkeypatch, caplog):
    with LLM(tiny_gguf, quantization="gguf", num_kv_blocks=64, enable_prefix_caching=False) as llm:
        want = _generate(llm)
    plan = LlamaForCausalLM.decode_plan

    def reshaped(model):  # a Llama whose layers came to compute something the C++ layers do not
        p = plan(model)
        return dataclasses.replace(p, layers=tuple(dataclasses.replace(x, kind="reshaped") for x in p.layers))

    monkeypatch.setattr(LlamaForCausalLM, "decode_plan", reshaped)
    with caplog.at_level(logging.WARNING, STEP_LOGGER):
        with LLM(tiny_gguf, quantization="gguf", num_kv_blocks=64, enable_prefix_caching=False) as llm:
            assert llm.engine.runner.cpu_decode_step is None
            assert _generate(llm) == want  # the per-layer path's tokens, the step's bits
    assert "not in the one-call CPU decode step: its decode plan has layers of kind reshaped" in caplog.text
