"""The Triton paged-attention kernels, single launch and split-KV, run by
Triton's interpreter on the CPU, against plain causal attention over each
sequence's own keys."""

from __future__ import annotations

import os

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before the kernel module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel tests need the triton package")

from shoal.workers.model_executor.layers.attention import triton_kernels, write_to_paged_cache
from shoal.workers.model_executor.layers.attention.triton_kernels import (
    SPLIT_KV_MAX_PROGRAMS,
    paged_attention,
    use_split_kv,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# (cached keys, new tokens): decodes, a full prefill, chunks after cached
# context, chunks spanning several query tiles, in mixed order.
STEP = [(0, 37), (16, 1), (40, 23), (99, 1), (0, 1), (5, 20), (31, 1), (64, 2)]
# Decode-only steps for the split-KV launch. With its NUM_SEGMENTS = 16: a
# 1-token context; 3 blocks, the last part-filled (13 segments left empty); 16
# blocks, one a segment; 19 blocks, two a segment, the 10th short and the last
# 6 empty.
DECODES = [(0, 1), (40, 1), (250, 1), (300, 1)]
# The same cases at a fraction of the interpreter's time, cut into 4 segments:
# 1 block (a 1-token context; one full block); 3 blocks (one segment empty);
# 5 and 7 blocks, two a segment, the last one short.
SHORT_DECODES = [(0, 1), (15, 1), (40, 1), (70, 1), (100, 1)]


def reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int], scale: float
) -> torch.Tensor:
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


@dataclass
class Step:
    """A step's kernel inputs, and each sequence's keys and values for the reference."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    q_lens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def attend(self, **kwargs) -> torch.Tensor:
        return paged_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            max(self.q_lens),
            self.scale,
            **kwargs,
        )

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    def reference(self) -> torch.Tensor:
        return reference(self.q, self.keys, self.values, self.q_lens, self.scale)


def make_step(step: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> Step:
    """`step` lists (cached keys, new tokens) a sequence; the cached keys are
    in the paged cache already, the new ones written as the engine does."""
    rng = random.Random(heads * dim)
    torch.manual_seed(heads * dim)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim).to(dtype)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # no sequence's blocks are contiguous or in order
    keys, values, tables, slots = [], [], [], []
    for cached, n in step:
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
    q_lens = [n for _, n in step]
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(keys, step)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(values, step)])
    write_to_paged_cache(new_keys, new_values, k_cache, v_cache, torch.cat(slots))
    max_blocks = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in step], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, dim).to(dtype)
    return Step(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q_lens, keys, values)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 32), (16, 2, 64), (6, 2, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_reference(heads, kv_heads, dim, dtype, tol):
    step = make_step(STEP, heads, kv_heads, dim, dtype)

    out = step.attend()

    assert out.dtype == dtype and out.shape == step.q.shape
    assert (out.float() - step.reference()).abs().max().item() <= tol


# GQA 1, 4 and 8; the tiny head sizes and 64.
@pytest.mark.parametrize("heads,kv_heads,dim", [(2, 2, 16), (4, 1, 64), (8, 1, 32)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_split_kv_equals_reference(heads, kv_heads, dim, dtype, tol, monkeypatch):
    monkeypatch.setattr(triton_kernels, "NUM_SEGMENTS", 4)  # the kernels take any count; see SHORT_DECODES
    step = make_step(SHORT_DECODES, heads, kv_heads, dim, dtype)

    out = step.attend(split_kv=True)

    assert out.dtype == dtype and out.shape == step.q.shape
    assert (out.float() - step.reference()).abs().max().item() <= tol


def test_split_and_single_launch_agree():
    step = make_step(DECODES, 3, 1, 32, torch.float32)  # GQA 3: a group padded to 4 rows
    split, single = step.attend(split_kv=True), step.attend(split_kv=False)
    assert (split - single).abs().max().item() <= 1e-5
    assert (split - step.reference()).abs().max().item() <= 1e-5


def test_split_kv_only_for_decode_steps_too_small_to_fill_the_gpu(monkeypatch):
    kv_heads = 8
    fit = SPLIT_KV_MAX_PROGRAMS // kv_heads  # sequences whose programs reach the limit
    assert use_split_kv(1, kv_heads, 1) and use_split_kv(fit - 1, kv_heads, 1)
    assert not use_split_kv(fit, kv_heads, 1)
    assert not use_split_kv(1, kv_heads, 2)  # a prefill chunk or two tokens in the step
    # paged_attention follows it: the merge kernel runs for a small decode step only.
    merges, merge = [], triton_kernels._merge_segments_kernel

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return merge[grid]

    monkeypatch.setattr(triton_kernels, "_merge_segments_kernel", Spy())
    for step, launches in (([(3, 1), (20, 1)], [(2, 2)]), ([(3, 1), (0, 5)], [(2, 2)])):
        batch = make_step(step, 4, 2, 16, torch.float32)
        assert (batch.attend() - batch.reference()).abs().max().item() <= 1e-5
        assert merges == launches  # (sequences, KV heads) for the decodes; none more for the mixed step


def test_engine_matches_torch_backend(tiny_model):
    from shoal.workers import LLM, SamplingParams

    rng = random.Random(5)
    # Ragged prompts over a 32-token step budget: chunked prefills share steps with decodes.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 40, 75)]
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model, dtype="float32", attention_backend=backend, max_num_batched_tokens=32, num_kv_blocks=64)
        assert llm.engine.runner.attn_backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_load_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="block_size"):
        triton_kernels.load(torch.device("cpu"), 8)
    # Compiled (not interpreted), the kernel needs CUDA tensors.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch; from shoal.workers.model_executor.layers.attention import triton_kernels as t; "
        "t.load(torch.device('cpu'), 16)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs CUDA" in proc.stderr
