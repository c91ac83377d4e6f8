"""The flash-attn backend against plain causal attention over keys gathered
from the paged cache, where flash_attn and CUDA are there; its refusals
everywhere."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.attention.backends.flash_attn import FlashAttentionBackend
from shoal.workers.model_executor.layers.attention.backends.varlen import VarlenMetadata


def _flash_attn_runs() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


needs_flash_attn = pytest.mark.skipif(not _flash_attn_runs(), reason="flash_attn is not installed / no CUDA")

# flash-attn's paged cache takes blocks of a multiple of 256 slots.
BLOCK_SIZE = 256
NUM_BLOCKS = 16
# (cached keys, new tokens): decodes, a full prefill, chunks after cached
# context, chunks and contexts crossing block boundaries, in mixed order.
MIXED = [(0, 37), (16, 1), (40, 23), (300, 1), (0, 1), (250, 20), (31, 1), (600, 2)]
# Decodes only: flash-attn takes another path when max_query_len is 1.
DECODES = [(0, 1), (255, 1), (256, 1), (700, 1)]


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: list[list[int]],
    step: list[tuple[int, int]],
    scale: float,
) -> torch.Tensor:
    """Each sequence's queries are its last new-token positions."""
    outs, start = [], 0
    for table, (cached, n) in zip(tables, step):
        total = cached + n
        k, v = (cache[table].flatten(0, 1)[:total].float().transpose(0, 1) for cache in (k_cache, v_cache))
        qs = q[start : start + n].float().transpose(0, 1)  # [heads, n, dim]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(cached)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.gpu
@needs_flash_attn
@pytest.mark.parametrize("step", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 128), (6, 2, 64)])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
def test_flash_attn_equals_reference(step, heads, kv_heads, dim, dtype, tol):
    device = torch.device("cuda")
    torch.manual_seed(heads * dim)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, device=device).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim, device=device).to(dtype)
    free = torch.randperm(NUM_BLOCKS).tolist()  # no sequence's blocks are contiguous or in order
    tables = [[free.pop() for _ in range(cdiv(c + n, BLOCK_SIZE))] for c, n in step]
    max_blocks = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([c + n for c, n in step], dtype=torch.int32, device=device)
    q_lens = [n for _, n in step]
    query_start_loc = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, device=device).to(dtype)
    backend = FlashAttentionBackend()
    backend.validate(device, dtype, BLOCK_SIZE)
    layer = SimpleNamespace(k_cache=k_cache, v_cache=v_cache, scale=dim**-0.5)
    slots = torch.zeros(0, dtype=torch.long, device=device)  # the layer writes the cache; the impl only reads it
    meta = VarlenMetadata(slots, block_tables, seq_lens, query_start_loc, max(q_lens))

    out = backend.impl_cls().forward(layer, q, None, None, meta)

    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_cache, v_cache, tables, step, dim**-0.5)
    assert (out.float() - ref).abs().max().item() <= tol


def test_validate_refuses_what_flash_attn_cannot_run(monkeypatch):
    backend, half = FlashAttentionBackend(), torch.float16
    with pytest.raises(ValueError, match="needs float16 or bfloat16"):
        backend.validate(torch.device("cuda"), torch.float32, BLOCK_SIZE)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        backend.validate(torch.device("cpu"), half, BLOCK_SIZE)
    # Neither needs a GPU to be there: both are refused before any CUDA call.
    with pytest.raises(ValueError, match="multiple of 256"):
        backend.validate(torch.device("cuda"), half, 16)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed
    with pytest.raises(RuntimeError, match="needs the flash_attn package"):
        backend.validate(torch.device("cuda"), half, BLOCK_SIZE)
