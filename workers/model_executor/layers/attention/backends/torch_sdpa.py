"""The pure-torch backend (SDPA): runs anywhere and is the reference for
the others.

Prefill chunks attend over their fresh keys, or over their blocks gathered
from the cache when context came before them. Decodes are split into groups
of similar context length, each gathered block-wise into a reusable buffer
and run as one masked SDPA call. The cpu_kernel backend shares the prefill
half and the metadata's pieces.

A layer with a sliding window W lets the query at position p see keys
p - W < k <= p (transformers' sliding_window_overlay). Its masks add that
bound, and only the blocks that hold such keys are gathered: a decode reads
at most cdiv(W, block_size) + 1 blocks however long its context. The
metadata is the step's, shared by every layer, so a window's decode groups
are built by the first layer that has it and kept for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.attention.backends.abstract import AttentionLayer, CommonAttentionMetadata
from shoal.workers.model_executor.layers.attention.kv_cache import dequantize_fp8, fp8_round_trip, is_fp8, layer_scales
from shoal.workers.profiling import step_range


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
    # [end - start, max_blocks], padded; under a window, each row from the
    # first block that holds a key in its window
    block_tables: torch.Tensor
    context_lens: torch.Tensor  # [end - start]
    mask: torch.Tensor | None  # [end - start, 1, 1, max_blocks * block_size], True = attend (torch path)


@dataclass(slots=True)
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: where each new key/value goes
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # What windowed layers need: the step's host lists, and the decode groups
    # cut to each window, built once per step by the first layer with it.
    common: CommonAttentionMetadata | None = None
    block_size: int = 0
    windowed_decodes: dict[int, list[DecodeGroup]] = field(default_factory=dict)

    def decodes_for(self, window: int | None) -> list[DecodeGroup]:
        """The decode groups as a layer with this sliding window reads them."""
        if not window or not self.decodes:
            return self.decodes
        common = cast(CommonAttentionMetadata, self.common)  # the builder sets it beside the decodes
        lens = common.seq_lens_cpu
        if all(max(lens[g.start : g.end]) <= window for g in self.decodes):
            return self.decodes  # every key is in the window
        groups = self.windowed_decodes.get(window)
        if groups is None:
            tables, device = common.block_tables_cpu, self.slot_mapping.device
            groups = [
                decode_group(lens, tables, g.start, g.end, self.block_size, device, True, window) for g in self.decodes
            ]
            self.windowed_decodes[window] = groups
        return groups


def prefill_chunks(common: CommonAttentionMetadata, block_size: int, device: torch.device) -> list[PrefillChunk]:
    """A chunk per row of more than one new token (on the CPU, its block
    table is no copy)."""
    chunks = []
    q_start = common.num_decodes
    for i in range(common.num_decodes, len(common.query_lens)):
        n, seq_len = common.query_lens[i], common.seq_lens_cpu[i]
        table = None
        if seq_len > n:  # context came before the chunk
            table = torch.tensor(common.block_tables_cpu[i][: cdiv(seq_len, block_size)], device=device)
        chunks.append(PrefillChunk(q_start, q_start + n, seq_len, table))
        q_start += n
    return chunks


def padded_table(rows: list[list[int]], width: int) -> np.ndarray:
    """int64 [len(rows), width]: each row's first `width` ids, padded with 0,
    from one flat list (3x faster than torch.tensor of nested lists, which
    costs microseconds a row, every step)."""
    flat: list[int] = []
    for r in rows:
        flat += r if len(r) <= width else r[:width]
        flat += [0] * (width - len(r))
    return np.fromiter(flat, np.int64, len(rows) * width).reshape(len(rows), width)


def decode_group(
    seq_lens: list[int],
    tables: list[list[int]],
    start: int,
    end: int,
    block_size: int,
    device: torch.device,
    masked: bool,
    window: int | None = None,
    tables_np: np.ndarray | None = None,
) -> DecodeGroup:
    """Decodes [start, end): block tables padded with 0 to the longest, and
    (masked) the mask that hides the padding. window: each row's table starts
    at the block of its window's first key, and the mask hides the keys
    before that key too. tables_np: the same tables as one array
    (CommonAttentionMetadata.block_tables_np), read where it has them."""
    firsts: list[int] = []
    if window:
        firsts = [max(0, n - window) // block_size for n in seq_lens[start:end]]
        max_blocks = max(cdiv(n, block_size) - f for f, n in zip(firsts, seq_lens[start:end]))
    else:
        max_blocks = cdiv(max(seq_lens[start:end]), block_size)
    if not window and tables_np is not None and tables_np.shape[1] >= max_blocks:
        table = np.ascontiguousarray(tables_np[start:end, :max_blocks])  # no Python work a row
    else:
        # Unwindowed rows keep any blocks past their end (masked).
        rows = [t[f : f + max_blocks] for t, f in zip(tables[start:end], firsts)] if window else tables[start:end]
        table = padded_table(rows, max_blocks)
    block_tables = torch.from_numpy(table).to(device)
    lens = torch.tensor(seq_lens[start:end], dtype=torch.long, device=device)
    mask = None
    if masked:
        pos = torch.arange(max_blocks * block_size, device=device).unsqueeze(0)
        if window:  # key j of a row's gathered blocks is at position first * block_size + j
            pos = pos + torch.tensor(firsts, dtype=torch.long, device=device).unsqueeze(1) * block_size
        mask = pos < lens.unsqueeze(1)
        if window:
            mask &= pos >= (lens - window).unsqueeze(1)
        mask = mask[:, None, None]
    return DecodeGroup(start, end, block_tables, lens, mask)


class TorchSDPAMetadataBuilder:
    # A new decode group starts where padding to its longest would waste
    # more than this share of the keys read.
    MAX_WASTE = 0.25

    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device

    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        chunks = prefill_chunks(common, self.block_size, self.device)
        return TorchSDPAMetadata(common.slot_mapping, self._decode_groups(common), chunks, common, self.block_size)

    def _decode_groups(self, common: CommonAttentionMetadata) -> list[DecodeGroup]:
        lens, tables = common.seq_lens_cpu, common.block_tables_cpu
        groups, start = [], 0
        while start < common.num_decodes:
            longest = lens[start]
            end, total = start, 0
            while end < common.num_decodes:
                n = lens[end]
                if total + n < (1 - self.MAX_WASTE) * longest * (end - start + 1):
                    break
                total += n
                end += 1
            groups.append(
                decode_group(
                    lens, tables, start, end, self.block_size, self.device, True, tables_np=common.block_tables_np
                )
            )
            start = end
        return groups


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

    def gather(self, block_tables: torch.Tensor, cache: torch.Tensor, slot: int) -> torch.Tensor:
        """[n, max_blocks] block ids -> [n, max_blocks * block_size, kv_heads, dim],
        copied whole blocks at a time into buffer `slot`."""
        n, m = block_tables.shape
        block_shape = cache.shape[1:]
        out = self.get(slot, n * m * cache[0].numel(), cache).view(n * m, *block_shape)
        torch.index_select(cache, 0, block_tables.reshape(-1), out=out)
        return out.view(n, m * block_shape[0], *block_shape[1:])

    def read(self, block_tables: torch.Tensor, cache: torch.Tensor, slot: int, scale: float, dtype: torch.dtype):
        """gather, widened to `dtype` where the cache is fp8 (times its scale)."""
        out = self.gather(block_tables, cache, slot)
        return dequantize_fp8(out, scale, dtype) if is_fp8(cache) else out


def prefill_attention(
    workspace: GatherWorkspace,
    layer: AttentionLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefills: list[PrefillChunk],
    out: torch.Tensor,
) -> None:
    """Each chunk's queries attend causally over its context (under the
    layer's sliding window, if any), into `out`."""
    window = layer.sliding_window
    k_scale, v_scale = layer_scales(layer)
    for p in prefills:
        n = p.end - p.start
        w = window if window and window < p.context_len else None  # else every key is in every query's window
        qs = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        first = 0  # position of the first key attended to (a multiple of the block size)
        if p.block_table is None:
            ks, vs = k[p.start : p.end], v[p.start : p.end]
            if is_fp8(layer.k_cache):  # see what the cache holds, as every other read does
                ks, vs = fp8_round_trip(ks, k_scale), fp8_round_trip(vs, v_scale)
        else:
            # The chunk's first query, at context_len - n, sees nothing before its window.
            first_block = max(0, p.context_len - n - w + 1) // layer.k_cache.shape[1] if w else 0
            table = p.block_table[first_block:][None]
            first = first_block * layer.k_cache.shape[1]
            ks = workspace.read(table, layer.k_cache, 0, k_scale, q.dtype)[0, : p.context_len - first]
            vs = workspace.read(table, layer.v_cache, 1, v_scale, q.dtype)[0, : p.context_len - first]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        if n == p.context_len and not w:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scale, enable_gqa=True)
        else:
            # Query i is at position context_len - n + i, key j at first + j:
            # j - i <= diag (causal) and, under a window, j - i > diag - w.
            diag = p.context_len - n - first
            mask = torch.ones(n, ks.shape[2], dtype=torch.bool, device=q.device).tril(diag)
            if w:
                mask = mask.triu(diag - w + 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=layer.scale, enable_gqa=True)
        out[p.start : p.end] = o[0].transpose(0, 1)


class TorchSDPAImpl:
    def __init__(self):
        self.workspace = GatherWorkspace()

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchSDPAMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        k_scale, v_scale = layer_scales(layer)
        with step_range("attention_decode"):
            for g in metadata.decodes_for(layer.sliding_window):
                # One batched call per group: gather each one's blocks (whole
                # blocks copy at memory speed) into a padded
                # [n, kv_heads, max_blocks * block_size, dim] and mask the padding.
                kd = self.workspace.read(g.block_tables, layer.k_cache, 0, k_scale, q.dtype).transpose(1, 2)
                vd = self.workspace.read(g.block_tables, layer.v_cache, 1, v_scale, q.dtype).transpose(1, 2)
                o = F.scaled_dot_product_attention(
                    q[g.start : g.end].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=layer.scale, enable_gqa=True
                )
                out[g.start : g.end] = o.squeeze(2)
        with step_range("attention_prefill"):
            prefill_attention(self.workspace, layer, q, k, v, metadata.prefills, out)
        return out


class TorchSDPABackend:
    name = "torch"
    varlen = False
    uses_cpu_kernels = False
    supports_fp8_kv_cache = True
    metadata_cls = TorchSDPAMetadata
    builder_cls = TorchSDPAMetadataBuilder
    impl_cls = TorchSDPAImpl

    def validate(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        """Runs anywhere."""
