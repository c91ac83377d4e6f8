"""--quantization gguf: a GGUF file's matrices kept in their blocks and
multiplied on them (layers/quantization/gguf.py).

A tiny Llama written as llama.cpp's converter writes it, each matrix in a
different block type (q, k and v of one fused layer in three), is checked:
- kept as blocks that expand to exactly the weights --quantization none
  loads, at a quarter of their bytes or less;
- without the compiled kernels (the blocks expanded per call), token for
  token equal to --quantization none: loading, the q/k row order, the fused
  parts and the tied or untied head are right;
- with them (8-bit activations, integer dot products as llama.cpp), every
  greedy token given the same prefix agrees with none's on most positions
  (the kernels' own error bound is checked in test_gguf_kernels.py);
- a type shoal does not compute, a cut through a block, a folder, a
  quantized config.json: each refused with the reason.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from tiny_gguf import write_llama_gguf
from tiny_models import make_tiny_model

from shoal.workers import LLM, SamplingParams
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.layers.quantization import get_quantization_config
from shoal.workers.model_executor.layers.quantization.gguf import GGUFBlocks, GGUFConfig
from shoal.workers.model_executor.loader.model_loader import (
    build_model,
    load_model_files,
    model_weights,
    resolve_quantization,
    weight_bytes,
)
from shoal.workers.model_executor.platforms.cpu.gguf_blocks import dequantize

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
}
# The K-quants need rows of 256: a wider tiny model, with random blocks (tiny_gguf.write_llama_gguf).
K_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q5_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_K,
    "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q6_K,
}
PROMPTS = ["Hello world", "The quick brown", "def add(a, b):", "Numbers: 0 1 2"]
ENGINE = dict(num_threads=1, num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("gguf-q")
    hf = make_tiny_model(str(d / "hf"))
    tied = make_tiny_model(str(d / "hf-tied"), tie_word_embeddings=True)
    return {
        "hf": hf,
        "q": write_llama_gguf(hf, str(d / "q.gguf"), TYPES),
        "tied": write_llama_gguf(tied, str(d / "tied.gguf"), TYPES),
        "q5_0": write_llama_gguf(hf, str(d / "q5_0.gguf"), {"ffn_up": Q.Q5_0}),
        "k": write_llama_gguf(
            make_tiny_model(str(d / "hf-wide"), hidden_size=256, intermediate_size=512, tie_word_embeddings=True),
            str(d / "k.gguf"),
            K_TYPES,
        ),
    }


def _models(path: str):
    g, n = load_model_files(path), load_model_files(path)
    quant = build_model(
        g.config, model_weights(g, "auto", CPU, "gguf"), 64, CPU, torch.float32, quant_config=GGUFConfig()
    )
    plain = build_model(n.config, model_weights(n, "auto", CPU), 64, CPU, torch.float32)
    return quant, plain


@pytest.mark.parametrize("which", ["q", "tied"])
def test_the_blocks_expand_to_the_weights_none_loads_at_a_quarter_of_the_bytes(tiny, which):
    quant, plain = _models(tiny[which])
    plain_params = dict(plain.named_parameters())
    for name, p in quant.named_parameters():
        groups = getattr(p, "gguf_groups", None)
        if groups is None:
            torch.testing.assert_close(p, plain_params[name], rtol=0, atol=0)
            continue
        expanded = torch.cat([d if t == 0 else dequantize(d, t, c) for t, d, c in groups])
        torch.testing.assert_close(expanded, plain_params[name], rtol=0, atol=0)
    qkv = quant.layers[0].self_attn.qkv_proj.weight.gguf_groups
    assert [t for t, _, _ in qkv] == [Q.Q4_0, Q.Q8_0, Q.Q4_1]  # three parts, three types, kept apart
    if which == "tied":
        assert quant.lm_head.weight is quant.embed_tokens.weight
    assert weight_bytes(quant) < weight_bytes(plain) / 3.5


@pytest.mark.parametrize("which", ["q", "tied", "k"])
def test_without_the_kernels_gguf_equals_none_token_for_token(tiny, which):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny[which], quantization="none", cpu_kernels=False, **ENGINE) as none:
        want = [o.token_ids for o in none.generate(PROMPTS, sp)]
    with LLM(tiny[which], quantization="gguf", cpu_kernels=False, **ENGINE) as q:
        assert [o.token_ids for o in q.generate(PROMPTS, sp)] == want


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The share of positions where `llm`'s greedy token, given the prompt and
    the continuation up to there, is the continuation's next token: one
    early difference does not decide every later position."""
    asks = [p + c[:i] for p, c in zip(prompts, continuations) for i in range(len(c))]
    got = [o.token_ids[0] for o in llm.generate(asks, SamplingParams(temperature=0, max_tokens=1))]
    want = [t for c in continuations for t in c]
    return sum(a == b for a, b in zip(got, want)) / len(want)


@pytest.mark.parametrize("which", ["q", "k"])
def test_with_the_kernels_gguf_follows_none_on_most_positions(tiny, which):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(tiny[which], quantization="none", **ENGINE) as none:
        ids = [none.tokenizer.encode(p) for p in PROMPTS]
        ref = [o.token_ids for o in none.generate(ids, sp)]
    with LLM(tiny[which], quantization="gguf", **ENGINE) as q:
        model = q.engine.model_executor.driver_worker.runner.model
        assert model.layers[0].mlp.down_proj.cpu_kernels is not None  # the kernels ran
        agreement = teacher_forced_agreement(q, ids, ref)
    print(f"\n{which}: teacher-forced greedy agreement with none: {agreement:.1%}")
    assert agreement >= 0.8


def test_a_type_shoal_does_not_compute_is_refused_by_name_and_expands_under_none(tiny):
    with pytest.raises(ValueError, match="Q5_0 is not computed on its blocks.*--quantization none"):
        LLM(tiny["q5_0"], quantization="gguf", **ENGINE)
    with LLM(tiny["q5_0"], **ENGINE) as none:  # auto: a type not computed on blocks expands the file
        assert len(none.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_a_row_parallel_cut_through_a_block_is_refused():
    rows = gguf.quants.quantize(np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32), Q.Q4_0)
    b = GGUFBlocks(torch.from_numpy(rows), Q.Q4_0, 128)
    assert b.narrow(1, 64, 64).data.shape == (4, 2 * 18)  # whole blocks: the bytes of columns 64..127
    torch.testing.assert_close(
        dequantize(b.narrow(1, 64, 64).data, Q.Q4_0, 64), dequantize(b.data, Q.Q4_0, 128)[:, 64:]
    )
    with pytest.raises(ValueError, match="tensor parallelism would cut Q4_0 blocks of 32 columns"):
        b.narrow(1, 48, 80)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_torch_expansion_equals_gguf_dequantize(qtype):
    w = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(blocks, qtype)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(blocks), qtype, 96).numpy(), want)


def test_which_method_serves_the_weights(tiny, tmp_path):
    q, folder = load_model_files(tiny["q"]), load_model_files(tiny["hf"])
    assert resolve_quantization("auto", q, "cpu", "auto") == "gguf"  # the file's own blocks on the CPU
    assert resolve_quantization("auto", q, "cuda", "auto") is None
    assert resolve_quantization("none", q, "cpu", "auto") is None
    assert resolve_quantization("auto", load_model_files(tiny["q5_0"]), "cpu", "auto") is None  # Q5_0: expanded
    assert resolve_quantization("auto", load_model_files(tiny["k"]), "cpu", "auto") == "gguf"
    assert EngineArgs().quantization == "auto"  # the default: a quantized .gguf on the CPU keeps its blocks
    assert resolve_quantization("auto", folder, "cpu", "auto") is None
    assert get_quantization_config("gguf") is GGUFConfig
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        resolve_quantization("gguf", folder, "cpu", "auto")
    with pytest.raises(ValueError, match="computes on the CPU"):
        resolve_quantization("gguf", q, "cuda", "auto")
    with pytest.raises(ValueError, match="load-format dummy has none"):
        resolve_quantization("gguf", q, "cpu", "dummy")
    # A quantized folder shoal cannot load is refused at start, naming its method.
    qdir = shutil.copytree(tiny["hf"], tmp_path / "fp8")
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        LLM(str(qdir), **ENGINE)
