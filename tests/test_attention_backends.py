"""The compiled CPU decode kernel against the pure-torch backend, and both
against transformers."""

from __future__ import annotations

import random

import pytest
import torch
from reference import check_tokens, hf_greedy

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers import cpu_kernels
from shoal.workers.model_executor.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedAttention,
    set_forward_context,
)
from shoal.workers.utils import cdiv


@pytest.mark.parametrize(
    "heads,kv_heads,block_size,dim", [(9, 3, 16, 32), (4, 4, 8, 64), (8, 2, 4, 32), (4, 2, 16, 12), (4, 2, 16, 136)]
)
def test_kernel_equals_torch_path(heads, kv_heads, block_size, dim):
    kernel = cpu_kernels.load()
    assert kernel is not None, "the CPU decode kernel did not build (is a C++ compiler installed?)"
    rng = random.Random(0)
    num_blocks = 200  # dim 12 takes the kernel's plain loops, the others its AVX2 path (136: 64 + 64 + 8 dims)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    lens = [1, 5, block_size, block_size + 1, 77, 130]
    max_blocks = cdiv(max(lens), block_size)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.tensor([[free.pop() for _ in range(max_blocks)] for _ in lens])
    lens_t = torch.tensor(lens)
    q = torch.randn(len(lens), heads, dim)
    mask = (torch.arange(max_blocks * block_size)[None] < lens_t[:, None])[:, None, None]

    def run(decode_kernel):
        attn = PagedAttention(heads, kv_heads, dim)
        attn.k_cache, attn.v_cache, attn.decode_kernel = k_cache, v_cache, decode_kernel
        # writing the "new" keys: rewrite each sequence's last slot with itself
        last = [tables[i, (n - 1) // block_size].item() * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
        flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(last), decodes=[DecodeGroup(0, len(lens), tables, lens_t, mask)]
        )
        with set_forward_context(meta):
            return attn(q, flat_k[last].clone(), flat_v[last].clone())

    torch.testing.assert_close(run(kernel), run(None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_both_backends_match_transformers(tiny_model, backend):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 40, 130, 260)]
    llm = LLM(tiny_model, num_kv_blocks=256, attention_backend=backend)
    assert (llm.engine.runner.decode_kernel is not None) == (backend == "cpu_kernel")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    refs = hf_greedy(hf, prompts, 16, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes
