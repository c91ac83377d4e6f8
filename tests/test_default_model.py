"""Slow tier: the real default model, SmolLM2-135M-Instruct (GGUF), against
transformers loading the same file."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from reference import check_setting, check_tokens, hf_greedy

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.loader.model_loader import default_model_path

pytestmark = pytest.mark.slow

MAX_NEW = 12
LENGTHS = [1, 2, 3, 8, 16, 33, 64, 100, 150, 200, 260, 320, 400, 470, 540, 600]
SETTINGS = {
    "plain": dict(),
    # 640 token slots for 16 prompts up to 612 tokens, prefilled in 64-token
    # chunks: a long prefill outgrows the cache that later arrivals took.
    "preempt": dict(num_kv_blocks=40, max_num_batched_tokens=64),
    "chunked": dict(max_num_batched_tokens=64),
    "prefix": dict(),
}


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


def prompts_for(setting: str) -> list[list[int]]:
    rng = random.Random(0)
    vocab = 49152
    if setting == "prefix":
        shared = [rng.randrange(vocab) for _ in range(400)]
        return [
            shared[: rng.choice([128, 256, 400])] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
            for _ in range(16)
        ]
    lengths = list(LENGTHS)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def references(hf_model):
    cache = {}

    def get(setting, prompts, eos):
        key = "prefix" if setting == "prefix" else "plain"
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompts, MAX_NEW, eos)
        return cache[key]

    return get


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_smollm2_greedy_matches_transformers(gguf_path, hf_model, references, setting):
    llm = LLM(None, dtype="float32", quantization="none", **SETTINGS[setting])  # expanded, as transformers
    prompts = prompts_for(setting)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    refs = references(setting, prompts, llm.engine.eos_token_ids)
    notes = [check_tokens(hf_model, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    print(setting, "near-ties:", [n for n in notes if n])
    check_setting(llm.engine.stats(), setting, notes)


def test_gguf_tokenizer_matches_transformers(gguf_path):
    from transformers import AutoTokenizer

    from shoal.proto.gguf_file import GGUFFile
    from shoal.proto.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf_metadata(GGUFFile(gguf_path).metadata)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    texts = [
        "Hello world",
        "  leading spaces and trailing  ",
        "<|im_start|>user\nHi<|im_end|>\n",
        "Émile's café – 日本語, emojis 🙂🚀",
        "def f(x):\n\treturn x ** 2  # comment",
        "1234567890 3.14159",
        "MiXeD CaSe\r\nnewlines\n\n\n",
        "",
    ]
    for t in texts:
        assert ours.encode(t) == ref(t).input_ids, t
        assert ours.decode(ours.encode(t), skip_special_tokens=False) == ref.decode(ref(t).input_ids)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == ref.eos_token_id


def test_cli_generate_prints_load_time():
    shoal = os.path.join(os.path.dirname(sys.executable), "shoal")
    r = subprocess.run(
        [shoal, "generate", "Name a colour.", "--max-tokens", "8"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "loaded SmolLM2-135M-Instruct in" in r.stderr
    assert r.stdout.strip()
