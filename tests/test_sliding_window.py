"""Sliding-window attention: the query at position p sees keys p - W < k <= p
(transformers' sliding_window_overlay). Every backend against a dense
reference computed here, on steps of fresh prefills, chunks after cached
context, and decodes shorter than, as long as and longer than the window;
then whole engines against transformers' generate.

The cache blocks that lie wholly before every key a sequence's queries see
are filled with NaN: a backend that read them would return NaN, so the
kernels are checked to skip them as well as to mask."""

from __future__ import annotations

import os

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before the kernel module is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random
import sys
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import pytest
import torch
from reference import check_tokens, hf_greedy
from tiny_models import make_tiny_model

from shoal.benchmarks.kv_window_memory import kv_bytes_per_sequence
from shoal.proto.utils import cdiv
from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.attention import PagedAttention, set_forward_context
from shoal.workers.model_executor.layers.attention.backends.abstract import CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelBackend
from shoal.workers.model_executor.layers.attention.backends.flash_attn import FlashAttentionImpl
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import TorchSDPABackend
from shoal.workers.model_executor.layers.attention.backends.varlen import VarlenMetadata
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

CPU = torch.device("cpu")
BLOCK = 16
NUM_BLOCKS = 128
# Windows: smaller than a block, not a multiple of the block size, a multiple.
WINDOWS = [7, 20, 32]


def decodes(w: int) -> list[tuple[int, int]]:
    """(cached keys, new tokens) a sequence, longest context first as the
    runner orders decodes: contexts of 150 and 300 (several blocks past the
    window), w + 1, w, w - 1 and 6."""
    return [(299, 1), (149, 1), (w, 1), (w - 1, 1), (w - 2, 1), (5, 1)]


def prefills(w: int) -> list[tuple[int, int]]:
    """A fresh prefill longer than the window, chunks after cached context
    whose queries' windows span the context's edge, and a short chunk far
    past the window."""
    return [(0, 50), (30, 20), (w - 3, 9), (90, 3)]


def reference(q: torch.Tensor, keys, values, step, window: int) -> torch.Tensor:
    """Plain attention in float64: the new tokens of each sequence are its
    last positions; each sees the keys k with p - window < k <= p."""
    outs, start = [], 0
    for k, v, (cached, n) in zip(keys, values, step):
        group = q.shape[1] // k.shape[1]
        qs = q[start : start + n].double().transpose(0, 1)  # [heads, n, dim]
        ks = k.double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v.double().repeat_interleave(group, 1).transpose(0, 1)
        q_pos = torch.arange(cached, cached + n)[:, None]
        k_pos = torch.arange(cached + n)[None, :]
        seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
        scores = (qs @ ks.transpose(1, 2) * q.shape[2] ** -0.5).masked_fill(~seen, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).float()


@dataclass
class Step:
    step: list[tuple[int, int]]
    window: int
    q: torch.Tensor  # [T, heads, dim]
    new_k: torch.Tensor  # [T, kv_heads, dim]: this step's keys and values, already in the cache
    new_v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: list[list[int]]
    keys: list[torch.Tensor]  # each sequence's, as written (no NaN)
    values: list[torch.Tensor]

    @property
    def num_decodes(self) -> int:
        return sum(1 for c, n in self.step if n == 1 and c > 0)

    def common(self) -> CommonAttentionMetadata:
        lens = [c + n for c, n in self.step]
        slots = [
            t[p // BLOCK] * BLOCK + p % BLOCK for t, (c, n) in zip(self.tables, self.step) for p in range(c, c + n)
        ]
        return CommonAttentionMetadata(
            slot_mapping=torch.tensor(slots),
            max_query_len=max(n for _, n in self.step),
            num_decodes=self.num_decodes,
            query_lens=[n for _, n in self.step],
            seq_lens_cpu=lens,
            block_tables_cpu=self.tables,
        )

    def varlen(self) -> VarlenMetadata:
        max_blocks = max(map(len, self.tables))
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in self.tables], dtype=torch.int32)
        seq_lens = torch.tensor([c + n for c, n in self.step], dtype=torch.int32)
        qsl = torch.tensor([0] + [n for _, n in self.step]).cumsum(0).to(torch.int32)
        return VarlenMetadata(self.common().slot_mapping, block_tables, seq_lens, qsl, max(n for _, n in self.step))

    def reference(self) -> torch.Tensor:
        return reference(self.q, self.keys, self.values, self.step, self.window)


def make_step(step: list[tuple[int, int]], window: int, heads: int, kv_heads: int, dim: int) -> Step:
    rng = random.Random(heads * dim + window)
    torch.manual_seed(heads * dim + window)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim)
    free = list(range(1, NUM_BLOCKS))  # block 0 pads short rows of block tables: it stays finite
    rng.shuffle(free)  # no sequence's blocks are contiguous or in order
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    keys, values, tables, new_k, new_v = [], [], [], [], []
    for cached, n in step:
        total = cached + n
        table = [free.pop() for _ in range(cdiv(total, BLOCK))]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        keys.append(torch.randn(total, kv_heads, dim))
        values.append(torch.randn(total, kv_heads, dim))
        flat_k[slots], flat_v[slots] = keys[-1], values[-1]
        new_k.append(keys[-1][cached:])
        new_v.append(values[-1][cached:])
        # The chunk's first query, at `cached`, sees nothing before cached - window + 1.
        for b in table[: max(0, cached - window + 1) // BLOCK]:
            k_cache[b], v_cache[b] = float("nan"), float("nan")
        tables.append(table)
    q = torch.randn(sum(n for _, n in step), heads, dim)
    return Step(step, window, q, torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, tables, keys, values)


def run_backend(backend, s: Step) -> torch.Tensor:
    """The step through a PagedAttention layer with the backend's builder and impl."""
    heads, dim = s.q.shape[1:]
    attn = PagedAttention(heads, s.k_cache.shape[2], dim, sliding_window=s.window)
    attn.k_cache, attn.v_cache, attn.impl = s.k_cache, s.v_cache, backend.impl_cls()
    meta = backend.builder_cls(BLOCK, CPU).build(s.common())
    with set_forward_context(meta):
        return attn(s.q, s.new_k, s.new_v).view(s.q.shape)


def host_backends():
    assert cpu_kernels.load() is not None, "the CPU kernels did not build (is a C++ compiler installed?)"
    return {"torch": TorchSDPABackend(), "cpu_kernel": CPUKernelBackend()}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (6, 2, 12)])  # the CPU kernel's AVX2 and plain loops
@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_host_backends_equal_the_dense_reference(backend, heads, kv_heads, dim, window):
    for step in (decodes(window) + prefills(window), decodes(window), prefills(window)):
        s = make_step(step, window, heads, kv_heads, dim)
        out = run_backend(host_backends()[backend], s)
        assert not out.isnan().any()
        torch.testing.assert_close(out, s.reference(), rtol=2e-5, atol=2e-5)


def test_windowed_decodes_gather_only_the_window_blocks():
    window = 20
    s = make_step(decodes(window), window, 4, 2, 32)
    meta = TorchSDPABackend.builder_cls(BLOCK, CPU).build(s.common())
    groups = meta.decodes_for(window)
    assert sum(g.end - g.start for g in groups) == len(s.step)
    assert max(g.block_tables.shape[1] for g in groups) <= cdiv(window, BLOCK) + 1
    assert meta.decodes_for(window) is groups  # built once a step, shared by the layers
    assert meta.decodes_for(None) is meta.decodes and meta.decodes_for(400) is meta.decodes
    assert max(g.block_tables.shape[1] for g in meta.decodes) == cdiv(300, BLOCK)


def test_cpu_kernel_without_a_window_reads_everything():
    """sliding_window 0 (the default) is full attention, as before."""
    kernels = cpu_kernels.load()
    s = make_step(decodes(20), 10**6, 4, 2, 32)
    meta = CPUKernelBackend.builder_cls(BLOCK, CPU).build(s.common())
    g = meta.decode
    full = kernels.paged_decode_attention(s.q, s.k_cache, s.v_cache, g.block_tables, g.context_lens, 32**-0.5)
    torch.testing.assert_close(full, s.reference(), rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="sliding_window >= 0"):
        kernels.paged_decode_attention(s.q, s.k_cache, s.v_cache, g.block_tables, g.context_lens, 1.0, -1)


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_kernels_equal_the_dense_reference(window, monkeypatch):
    pytest.importorskip("triton", reason="the Triton kernel tests need the triton package")
    from shoal.workers.model_executor.layers.attention import triton_kernels
    from shoal.workers.model_executor.layers.attention.backends.triton_attn import TritonAttentionBackend

    # GQA 3 (a group padded to 4 rows); the mixed step through the backend's impl.
    s = make_step(decodes(window) + prefills(window), window, 6, 2, 16)
    layer = SimpleNamespace(k_cache=s.k_cache, v_cache=s.v_cache, scale=16**-0.5, sliding_window=window)
    out = TritonAttentionBackend.impl_cls().forward(layer, s.q, s.new_k, s.new_v, s.varlen())
    assert not out.isnan().any()
    torch.testing.assert_close(out, s.reference(), rtol=1e-5, atol=1e-5)
    # Decodes alone, in both launches; the split one cut into 4 segments.
    monkeypatch.setattr(triton_kernels, "NUM_SEGMENTS", 4)
    s = make_step(decodes(window), window, 4, 1, 16)
    m = s.varlen()
    for split in (True, False):
        out = triton_kernels.paged_attention(
            s.q, s.k_cache, s.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, 1, 16**-0.5,
            sliding_window=window, split_kv=split,
        )  # fmt: skip
        assert not out.isnan().any()
        torch.testing.assert_close(out, s.reference(), rtol=1e-5, atol=1e-5)


def test_flash_attn_gets_the_window_it_documents(monkeypatch):
    """flash-attn is not installed here: a stand-in with its documented
    semantics (the query at bottom-right aligned position i sees keys
    [i - left, i + right]) records what the backend passes, and its output
    must equal the dense reference."""
    calls = []

    def fake_varlen(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, block_table):
        calls.append(window_size)
        left, right = window_size
        outs = []
        for i in range(len(cu_q) - 1):
            n, total = int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i])
            table = block_table[i, : cdiv(total, k_cache.shape[1])].long()
            ks, vs = (c[table].flatten(0, 1)[:total] for c in (k_cache, v_cache))
            q_pos = torch.arange(total - n, total)[:, None]  # bottom-right aligned
            k_pos = torch.arange(total)[None, :]
            seen = k_pos <= q_pos if causal else torch.ones(n, total, dtype=torch.bool)
            if left >= 0:
                seen &= k_pos >= q_pos - left
            if right >= 0:
                seen &= k_pos <= q_pos + right
            ks = torch.nan_to_num(ks).repeat_interleave(q.shape[1] // ks.shape[1], 1)
            vs = torch.nan_to_num(vs).repeat_interleave(q.shape[1] // vs.shape[1], 1)
            scores = torch.einsum("qhd,khd->hqk", q[cu_q[i] : cu_q[i + 1]], ks) * softmax_scale
            p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        return torch.cat(outs)

    fake = ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    window = 20
    s = make_step(decodes(window) + prefills(window), window, 4, 2, 32)
    impl = FlashAttentionImpl()
    layer = SimpleNamespace(k_cache=s.k_cache, v_cache=s.v_cache, scale=32**-0.5, sliding_window=window)
    out = impl.forward(layer, s.q, s.new_k, s.new_v, s.varlen())
    assert calls == [(window - 1, 0)]
    torch.testing.assert_close(out, s.reference(), rtol=1e-5, atol=1e-5)
    layer.sliding_window = None
    impl.forward(layer, s.q, s.new_k, s.new_v, s.varlen())
    assert calls[-1] == (-1, -1)


# Engines against transformers: prompts shorter than, as long as and much
# longer than the window (24) of every layer of a tiny Mistral.
PROMPT_LENS = (5, 24, 25, 70, 130, 200)
MAX_NEW = 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(
        str(tmp_path_factory.mktemp("tiny-mistral-window")), "mistral", sliding_window=24, head_dim=32
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(26)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]
    refs = hf_greedy(hf, prompts, MAX_NEW, [2])
    # The window changes what transformers generates (else these tests could not fail).
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None).eval()
    assert hf_greedy(full, prompts, MAX_NEW, [2]) != refs
    return path, hf, prompts, refs


# Triton runs under its interpreter here: only in the chunked engine, whose
# steps mix prefill chunks and decodes (the longest test of the file as it is).
@pytest.mark.parametrize(
    "backend,chunk",
    [("torch", 2048), ("torch", 32), ("cpu_kernel", 2048), ("cpu_kernel", 32), ("triton", 32)],
    ids=["torch-whole", "torch-chunked", "cpu_kernel-whole", "cpu_kernel-chunked", "triton-chunked"],
)
def test_mistral_with_a_window_matches_transformers(mistral, backend, chunk):
    path, hf, prompts, refs = mistral
    llm = LLM(path, dtype="float32", attention_backend=backend, max_num_batched_tokens=chunk, num_threads=1)
    assert llm.engine.max_model_len == 1024  # the model's own, not the window
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [24, 24]
    if backend == "cpu_kernel" and cpu_kernels.load().has_avx2:
        assert llm.engine.runner.cpu_decode_step is not None  # decode steps in the C++ layers, windowed
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_hybrid_windows_in_the_cpu_decode_step(tmp_path):
    """Qwen2 with a window on its second layer only: the C++ decode step
    takes each layer's own window."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(
        str(tmp_path / "qwen2-hybrid"), "qwen2", use_sliding_window=True, sliding_window=20, max_window_layers=1
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (10, 90, 160)]
    llm = LLM(path, dtype="float32", attention_backend="cpu_kernel", num_threads=1)
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [None, 20]
    if cpu_kernels.load().has_avx2:
        assert llm.engine.runner.cpu_decode_step is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    refs = hf_greedy(hf, prompts, MAX_NEW, llm.engine.eos_token_ids)
    notes = [check_tokens(hf, p, o.token_ids, r) for p, o, r in zip(prompts, outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_kv_window_memory_arithmetic():
    # 3 layers (2 local with a 20-token window, 1 global), 2 KV heads of 8 dims, 2 bytes each.
    cfg = ModelConfig(
        model_type="test", vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False, sliding_window=20,
        layer_sliding_windows=[20, 20, None],
    )  # fmt: skip
    slot = 2 * 2 * 8 * 2  # K and V, heads, dims, bytes: one token of one layer
    # 1000 tokens: 63 blocks of 16 a layer in one table; a local layer's own table keeps cdiv(20, 16) + 1 = 3.
    assert kv_bytes_per_sequence(cfg, 1000, 16, 2, per_group_tables=False) == 3 * 63 * 16 * slot
    assert kv_bytes_per_sequence(cfg, 1000, 16, 2, per_group_tables=True) == (63 + 2 * 3) * 16 * slot
    # A context within the window's blocks keeps them all either way.
    assert kv_bytes_per_sequence(cfg, 30, 16, 2, per_group_tables=True) == 3 * 2 * 16 * slot
