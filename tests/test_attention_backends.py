"""The attention backends as objects: the compiled CPU decode kernel
against the pure-torch backend, both against transformers, and the
selector's rules."""

from __future__ import annotations

import random

import pytest
import torch
from reference import check_tokens, hf_greedy

from shoal.proto.utils import cdiv
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.attention import PagedAttention, set_forward_context
from shoal.workers.model_executor.layers.attention.backends.abstract import CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelBackend
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPABackend
from shoal.workers.model_executor.layers.attention.selector import get_attn_backend
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

CPU = torch.device("cpu")


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
    lens = [130, 77, block_size + 1, block_size, 5, 1]  # decodes come longest first
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(cdiv(n, block_size))] for n in lens]
    q = torch.randn(len(lens), heads, dim)
    # writing the "new" keys: rewrite each sequence's last slot with itself
    last = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    common = CommonAttentionMetadata(
        slot_mapping=torch.tensor(last),
        max_query_len=1,
        num_decodes=len(lens),
        query_lens=[1] * len(lens),
        seq_lens_cpu=lens,
        block_tables_cpu=tables,
    )

    def run(backend):
        attn = PagedAttention(heads, kv_heads, dim)
        attn.k_cache, attn.v_cache, attn.impl = k_cache, v_cache, backend.impl_cls()
        flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
        meta = backend.builder_cls(block_size, CPU).build(common)
        assert isinstance(meta, backend.metadata_cls)
        with set_forward_context(meta):
            return attn(q, flat_k[last].clone(), flat_v[last].clone())

    torch.testing.assert_close(run(CPUKernelBackend()), run(TorchSDPABackend()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_both_backends_match_transformers(tiny_model, backend):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 40, 130, 260)]
    llm = LLM(tiny_model, num_kv_blocks=256, attention_backend=backend)
    assert llm.engine.runner.attn_backend.name == backend
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    refs = hf_greedy(hf, prompts, 16, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_the_selector_picks_as_auto_says_and_validates():
    assert cpu_kernels.load() is not None, "the CPU kernels did not build"

    def pick(*args, **kw) -> str:
        return get_attn_backend(*args, **kw).name

    assert pick("auto", CPU, torch.float32, 16) == "cpu_kernel"
    assert pick("auto", CPU, torch.float32, 16, use_cpu_kernels=False) == "torch"
    assert pick("auto", CPU, torch.bfloat16, 16) == "torch"
    assert pick("torch", CPU, torch.float32, 16) == "torch"
    with pytest.raises(ValueError, match="must be auto, torch"):
        get_attn_backend("sdpa", CPU, torch.float32, 16)
    for dtype, use in ((torch.bfloat16, True), (torch.float32, False)):
        with pytest.raises(RuntimeError, match="needs a CPU, float32"):
            get_attn_backend("cpu_kernel", CPU, dtype, 16, use_cpu_kernels=use)
    with pytest.raises(ValueError, match="needs float16 or bfloat16"):
        get_attn_backend("flash_attn", CPU, torch.float32, 256)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        get_attn_backend("flash_attn", CPU, torch.float16, 256)
