"""Attention over the paged KV cache: the pure-torch backend.

It runs anywhere and is the reference for faster backends. The model runner
puts each step's metadata in a small context object (set_forward_context)
instead of threading it through every forward.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PrefillChunk:
    """Queries [start, end) of the flat batch attend to `context_len` keys.
    `block_table` lists the blocks holding them; None means the chunk is the
    whole context, so the fresh keys are used as they are."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """One-token queries [start, end) of the flat batch, one per sequence,
    of similar context length so that padding them to the longest is cheap."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks], padded
    context_lens: torch.Tensor  # [end - start]
    mask: torch.Tensor | None  # [end - start, 1, 1, max_blocks * block_size], True = attend (torch path)


@dataclass(slots=True)
class TritonAttentionMetadata:
    """The whole step for the Triton kernel: sequence i owns queries
    query_start_loc[i]:query_start_loc[i + 1] of the flat batch, the last of
    its seq_lens[i] positions."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded
    seq_lens: torch.Tensor  # [num_seqs]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    max_query_len: int  # sizes the launch grid without reading the device


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    triton: TritonAttentionMetadata | None = None  # set instead of decodes/prefills


# Per thread: two engines in one process (an AsyncEngine's thread and an
# offline LLM in a test, say) must not see each other's step.
_local = threading.local()


@contextmanager
def set_forward_context(meta: AttentionMetadata):
    prev = getattr(_local, "meta", None)
    _local.meta = meta
    try:
        yield
    finally:
        _local.meta = prev


def get_forward_context() -> AttentionMetadata:
    meta = getattr(_local, "meta", None)
    assert meta is not None, "attention ran outside set_forward_context"
    return meta


class GatherWorkspace:
    """Reusable buffers for gathered keys and values, shared by all layers
    of one model: a fresh multi-megabyte tensor per layer and step costs
    more in page faults than the copy itself."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def get(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.buffers[slot] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


def write_to_paged_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [T, kv_heads, dim] go to flat slots `slot_mapping` of the
    caches [num_blocks, block_size, kv_heads, dim]; every backend reads them there."""
    k_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)


class PagedAttention(nn.Module):
    """Writes the step's keys/values into the cache, then attends.

    The cache of one layer is [num_blocks, block_size, num_kv_heads, head_dim];
    viewed flat, slot s is block s // block_size, offset s % block_size.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.workspace = GatherWorkspace()  # the model runner shares one across layers
        self.decode_kernel = None  # the compiled CPU kernel, when the runner has one
        self.triton_kernel = None  # triton_attention.paged_attention, when the runner's backend is triton

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [T, heads * dim]."""
        ctx = get_forward_context()
        write_to_paged_cache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if self.triton_kernel is not None:
            t = ctx.triton
            out = self.triton_kernel(
                q,
                self.k_cache,
                self.v_cache,
                t.block_tables,
                t.seq_lens,
                t.query_start_loc,
                t.max_query_len,
                self.scale,
            )
            return out.view(q.shape[0], -1)
        out = torch.empty_like(q)
        for g in ctx.decodes:
            if self.decode_kernel is not None:
                out[g.start : g.end] = self.decode_kernel.paged_decode_attention(
                    q[g.start : g.end], self.k_cache, self.v_cache, g.block_tables, g.context_lens, self.scale
                )
                continue
            # One batched call per group: gather each one's blocks (whole
            # blocks copy at memory speed) into a padded
            # [n, kv_heads, max_blocks * block_size, dim] and mask the padding.
            kd = self._gather(g.block_tables, self.k_cache, 0).transpose(1, 2)
            vd = self._gather(g.block_tables, self.v_cache, 1).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.start : g.end].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )
            out[g.start : g.end] = o.squeeze(2)
        for p in ctx.prefills:
            n = p.end - p.start
            qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_table is None:
                ks, vs = k[p.start : p.end], v[p.start : p.end]
            else:
                ks = self._gather(p.block_table[None], self.k_cache, 0)[0, : p.context_len]
                vs = self._gather(p.block_table[None], self.v_cache, 1)[0, : p.context_len]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            if n == p.context_len:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                # Queries are the last n positions of the context.
                mask = torch.ones(n, p.context_len, dtype=torch.bool, device=q.device).tril(p.context_len - n)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[p.start : p.end] = o[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _gather(self, block_tables: torch.Tensor, cache: torch.Tensor, slot: int) -> torch.Tensor:
        """[n, max_blocks] block ids -> [n, max_blocks * block_size, kv_heads, dim],
        copied whole blocks at a time into workspace buffer `slot`."""
        n, m = block_tables.shape
        block_shape = cache.shape[1:]
        out = self.workspace.get(slot, n * m * cache[0].numel(), cache).view(n * m, *block_shape)
        torch.index_select(cache, 0, block_tables.reshape(-1), out=out)
        return out.view(n, m * block_shape[0], *block_shape[1:])
