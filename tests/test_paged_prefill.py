"""The compiled prefill attention (csrc/paged_prefill_cpu.cpp) against a
float64 reference on odd shapes, bit for bit across thread counts, and the
cpu_kernel backend's prefill chunks against the torch backend's in one
mixed step."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.attention import PagedAttention, set_forward_context
from shoal.workers.model_executor.layers.attention.backends import cpu_kernel as cpu_kernel_backend
from shoal.workers.model_executor.layers.attention.backends.abstract import CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelBackend
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPABackend
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed?)"
    return k


def reference(q, k_cache, v_cache, tables, starts, chunks, scale, window):
    """Each chunk's queries over its keys gathered from the cache, in float64, with a dense mask."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    for table, start, (n, ctx) in zip(tables, starts, chunks):
        blocks = table[: cdiv(ctx, bs)]
        ks = k_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        vs = v_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        pos = torch.arange(ctx - n, ctx)[:, None]
        key = torch.arange(ctx)[None]
        mask = key <= pos
        if window:
            mask &= key > pos - window
        scores = torch.einsum("nhd,khd->hnk", q[start : start + n].double(), ks) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("hnk,khd->nhd", probs, vs)
    return out


def make_case(chunks, heads, kv_heads, dim, block_size, seed=0):
    """A cache with the chunks' blocks scattered, q as a strided view of a fused qkv."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(ctx, block_size) for _, ctx in chunks) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(cdiv(ctx, block_size))] for _, ctx in chunks]
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    total = sum(n for n, _ in chunks)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=g)
    return qkv[:, : heads * dim].view(total, heads, dim), k_cache, v_cache, tables, starts


def run_kernel(kernel, q, k_cache, v_cache, tables, starts, chunks, scale, window):
    width = max(map(len, tables))
    out = torch.full(q.shape, float("nan"))
    kernel.paged_prefill_attention(
        out,
        q,
        k_cache,
        v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(starts),
        torch.tensor([n for n, _ in chunks]),
        torch.tensor([ctx for _, ctx in chunks]),
        scale,
        window,
    )
    return out


def on_one_and_two_threads(fn, *args):
    """fn(*args) with torch on 1 thread, then on 2."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(*args)
        torch.set_num_threads(2)
        return one, fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "chunks,heads,kv_heads,dim,block_size,window",
    [
        ([(37, 37)], 9, 3, 64, 16, 0),  # a fresh prompt, not a multiple of the block size; GQA 3
        ([(100, 100)], 4, 4, 64, 16, 0),  # no grouping (ratio 1)
        ([(70, 93)], 8, 2, 64, 16, 0),  # a chunk starting mid-block after cached context; GQA 4
        ([(5, 200), (130, 130), (17, 40), (1, 9)], 12, 3, 64, 16, 50),  # several chunks, a sliding window
        ([(65, 300)], 8, 2, 64, 16, 64),  # a window of whole blocks
        ([(150, 1000)], 8, 2, 136, 32, 0),  # head size past the 32-wide loops (136 = 4 x 32 + 8)
        ([(33, 50), (7, 7)], 6, 3, 12, 8, 0),  # head size 12: the plain loops
        ([(200, 200)], 3, 1, 32, 4, 300),  # a window wider than the context
    ],
)
def test_kernel_matches_float64_reference_bit_identical_across_threads(
    kernel, chunks, heads, kv_heads, dim, block_size, window
):
    q, k_cache, v_cache, tables, starts = make_case(chunks, heads, kv_heads, dim, block_size)
    scale = dim**-0.5
    args = (kernel, q, k_cache, v_cache, tables, starts, chunks, scale, window)
    one, two = on_one_and_two_threads(run_kernel, *args)
    want = reference(q, k_cache, v_cache, tables, starts, chunks, scale, window)
    torch.testing.assert_close(one.double(), want, rtol=1e-5, atol=2e-6)
    assert torch.equal(one, two), "the result depends on the thread count"


def test_kernel_splits_long_chunks_across_threads_bit_identically(kernel):
    """Enough work that both threads take jobs (small steps run on one)."""
    chunks = [(600, 700), (300, 300)]
    q, k_cache, v_cache, tables, starts = make_case(chunks, 8, 2, 64, 16, seed=1)
    args = (kernel, q, k_cache, v_cache, tables, starts, chunks, 0.125, 0)
    one, two = on_one_and_two_threads(run_kernel, *args)
    assert torch.equal(one, two)
    want = reference(q, k_cache, v_cache, tables, starts, chunks, 0.125, 0)
    torch.testing.assert_close(one.double(), want, rtol=1e-5, atol=2e-6)


def test_kernel_refuses_bad_metadata(kernel):
    q, k_cache, v_cache, tables, starts = make_case([(10, 10)], 4, 2, 16, 8)
    with pytest.raises(RuntimeError, match="query_len <= context_len"):
        run_kernel(kernel, q, k_cache, v_cache, tables, starts, [(10, 9)], 0.25, 0)
    with pytest.raises(RuntimeError, match="within the block table"):
        run_kernel(kernel, q, k_cache, v_cache, tables, starts, [(10, 40)], 0.25, 0)
    with pytest.raises(RuntimeError, match="queries within q"):
        run_kernel(kernel, q[:5], k_cache, v_cache, tables, starts, [(10, 10)], 0.25, 0)


@pytest.mark.parametrize("window", [None, 24])
def test_mixed_step_matches_torch_backend(kernel, monkeypatch, window):
    """Decodes, a fresh prompt, a chunk after cached context starting
    mid-block and a fresh prompt past PAGED_PREFILL_MAX_FRESH (left to the
    torch path) in one step: the cpu_kernel backend's output is the torch
    backend's, and the kernel ran the chunks it should."""
    monkeypatch.setattr(cpu_kernel_backend, "PAGED_PREFILL_MAX_FRESH", 60)
    heads, kv_heads, dim, bs = 9, 3, 32, 16
    rng = random.Random(0)
    num_blocks = 120
    k_cache = torch.randn(num_blocks, bs, kv_heads, dim)
    v_cache = torch.randn(num_blocks, bs, kv_heads, dim)
    # (new tokens, context after the step): 3 decodes, then prompt chunks
    rows = [(1, 90), (1, 33), (1, 5), (45, 45), (29, 75), (70, 70)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(cdiv(ctx, bs))] for _, ctx in rows]
    slots = [t[p // bs] * bs + p % bs for t, (n, ctx) in zip(tables, rows) for p in range(ctx - n, ctx)]
    total = len(slots)
    q = torch.randn(total, heads, dim)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    common = CommonAttentionMetadata(
        slot_mapping=torch.tensor(slots),
        max_query_len=70,
        num_decodes=3,
        query_lens=[n for n, _ in rows],
        seq_lens_cpu=[ctx for _, ctx in rows],
        block_tables_cpu=tables,
    )

    def run(backend):
        attn = PagedAttention(heads, kv_heads, dim, sliding_window=window)
        attn.k_cache, attn.v_cache, attn.impl = k_cache, v_cache, backend.impl_cls()
        meta = backend.builder_cls(bs, CPU).build(common)
        with set_forward_context(meta):
            return attn(q, flat_k[slots].clone(), flat_v[slots].clone()), meta

    got, meta = run(CPUKernelBackend())
    want, _ = run(TorchSDPABackend())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the two shorter prompt chunks by the kernel, the 70-token fresh prompt by torch
    assert meta.paged is not None and meta.paged.query_lens.tolist() == [45, 29]
    assert meta.paged.query_starts.tolist() == [3, 48] and meta.paged.context_lens.tolist() == [45, 75]
    assert [p.end - p.start for p in meta.prefills] == [70]
    assert not meta.decode_only
