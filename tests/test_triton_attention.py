"""The Triton paged-attention kernel, run by Triton's interpreter on the CPU,
against plain causal attention over each sequence's own keys."""

from __future__ import annotations

import os

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before the kernel module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel tests need the triton package")

from shoal.workers.model_executor.layers import triton_attention
from shoal.workers.model_executor.layers.attention import write_to_paged_cache
from shoal.workers.model_executor.layers.triton_attention import paged_attention

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# (cached keys, new tokens): decodes, a full prefill, chunks after cached
# context, chunks spanning several query tiles, in mixed order.
STEP = [(0, 37), (16, 1), (40, 23), (99, 1), (0, 1), (5, 20), (31, 1), (64, 2)]


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int],
              scale: float) -> torch.Tensor:  # fmt: skip
    """Each sequence's queries are its last q_len positions."""
    outs, start = [], 0
    for k, v, n in zip(keys, values, q_lens):
        group = q.shape[1] // k.shape[1]
        qs = q[start : start + n].float().transpose(0, 1)  # [heads, n, dim]
        ks = k.float().repeat_interleave(group, 1).transpose(0, 1)
        vs = v.float().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril(k.shape[0] - n)
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 32), (16, 2, 64), (6, 2, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_reference(heads, kv_heads, dim, dtype, tol):
    rng = random.Random(heads * dim)
    torch.manual_seed(heads * dim)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim).to(dtype)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # no sequence's blocks are contiguous or in order
    keys, values, tables, slots = [], [], [], []
    for cached, n in STEP:
        total = cached + n
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        seq_slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)])
        keys.append(torch.randn(total, kv_heads, dim).to(dtype))
        values.append(torch.randn(total, kv_heads, dim).to(dtype))
        # The cached part is in place already; the new tokens are this step's write.
        k_cache.view(-1, kv_heads, dim)[seq_slots[:cached]] = keys[-1][:cached]
        v_cache.view(-1, kv_heads, dim)[seq_slots[:cached]] = values[-1][:cached]
        slots.append(seq_slots[cached:])
        tables.append(table)
    q_lens = [n for _, n in STEP]
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(keys, STEP)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(values, STEP)])
    write_to_paged_cache(new_keys, new_values, k_cache, v_cache, torch.cat(slots))
    max_blocks = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in STEP], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, dim).to(dtype)
    scale = dim**-0.5

    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max(q_lens), scale)

    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, keys, values, q_lens, scale)
    assert (out.float() - ref).abs().max().item() <= tol


def test_engine_matches_torch_backend(tiny_model):
    from shoal.workers import LLM, SamplingParams

    rng = random.Random(5)
    # Ragged prompts over a 32-token step budget: chunked prefills share steps with decodes.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 40, 75)]
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model, dtype="float32", attention_backend=backend, max_num_batched_tokens=32, num_kv_blocks=64)
        assert (llm.engine.runner.triton_kernel is not None) == (backend == "triton")
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_load_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="block_size"):
        triton_attention.load(torch.device("cpu"), 8)
    # Compiled (not interpreted), the kernel needs CUDA tensors.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch; from shoal.workers.model_executor.layers import triton_attention as t; "
            "t.load(torch.device('cpu'), 16)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr
