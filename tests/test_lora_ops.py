"""The grouped LoRA update (workers/lora/ops.py) against a per-row float64
reference: segments of any length (empty ones, one row, many), base rows
between them, adapters of different ranks padded to the slots' rank, an
output slice of a fused layer, and a bfloat16 output."""

from __future__ import annotations

import pytest
import torch

from shoal.workers.lora.ops import NO_LORA, Segment, add_lora, lora_segments

IN, OUT, SLOTS, MAX_RANK = 48, 40, 3, 16
RANKS = (4, 16, 8)  # slot s holds an adapter of rank RANKS[s], zero past it


def _slots(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.zeros(SLOTS, IN, MAX_RANK)
    b = torch.zeros(SLOTS, MAX_RANK, OUT)
    for s, r in enumerate(RANKS):
        a[s, :, :r] = torch.randn(IN, r, generator=gen)
        b[s, :r] = torch.randn(r, OUT, generator=gen)
    return a, b, torch.tensor([0.5, 2.0, 1.0 / 3.0])


def _reference(x, a, b, scalings, row_slots) -> torch.Tensor:
    """Row by row in float64, each adapter at its own rank (no padding)."""
    out = torch.zeros(x.shape[0], OUT, dtype=torch.float64)
    for i, s in enumerate(row_slots.tolist()):
        if s != NO_LORA:
            r = RANKS[s]
            out[i] = (x[i].double() @ a[s, :, :r].double()) @ b[s, :r].double() * float(scalings[s])
    return out


def _bound(x, a, b, scalings, row_slots) -> torch.Tensor:
    """float32 rounding of the two products and the scale: a few ulps of the sums of |terms|."""
    out = torch.zeros(x.shape[0], OUT, dtype=torch.float64)
    eps = torch.finfo(torch.float32).eps
    for i, s in enumerate(row_slots.tolist()):
        if s != NO_LORA:
            t = x[i].double().abs() @ a[s].double().abs()
            out[i] = (t @ b[s].double().abs()) * abs(float(scalings[s])) * (IN + MAX_RANK + 4) * eps
    return out + 1e-30


@pytest.mark.parametrize("seed", range(5))
def test_segments_add_each_rows_adapter_and_leave_base_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    a, b, scalings = _slots(gen)
    # runs of random length (0 included: an adapter with no rows this step) over base and the three slots
    row_slots = []
    for _ in range(12):
        row_slots += [int(torch.randint(-1, SLOTS, (1,), generator=gen))] * int(
            torch.randint(0, 6, (1,), generator=gen)
        )
    row_slots = torch.tensor(row_slots, dtype=torch.long)
    x = torch.randn(len(row_slots), IN, generator=gen)
    base = torch.randn(len(row_slots), OUT, generator=gen)
    y = add_lora(base.clone(), x, a, b, scalings, lora_segments(row_slots))
    want = base.double() + _reference(x, a, b, scalings, row_slots)
    assert ((y.double() - want).abs() <= _bound(x, a, b, scalings, row_slots) + 1e-6 * base.abs().double()).all()
    untouched = row_slots == NO_LORA
    assert torch.equal(y[untouched], base[untouched])


def test_segments_merge_consecutive_rows_and_skip_the_base():
    row_slots = torch.tensor([2, 2, -1, -1, 0, 1, 1, 1, -1, 2])
    assert lora_segments(row_slots) == [Segment(0, 2, 2), Segment(4, 1, 0), Segment(5, 3, 1), Segment(9, 1, 2)]
    assert lora_segments(torch.tensor([-1, -1])) == []
    assert lora_segments(torch.tensor([], dtype=torch.long)) == []


def test_padding_the_rank_changes_nothing():
    """A rank-4 adapter in a slot of 16 gives what the same adapter unpadded gives."""
    gen = torch.Generator().manual_seed(7)
    a, b, scalings = _slots(gen)
    x = torch.randn(5, IN, generator=gen)
    segs = [Segment(0, 5, 0)]
    padded = add_lora(torch.zeros(5, OUT), x, a, b, scalings, segs)
    exact = add_lora(torch.zeros(5, OUT), x, a[:1, :, :4].contiguous(), b[:1, :4].contiguous(), scalings[:1], segs)
    assert torch.allclose(padded, exact, rtol=1e-6, atol=1e-6)


def test_an_output_slice_of_a_fused_layer():
    """v_proj's update lands in its columns of qkv and nowhere else."""
    gen = torch.Generator().manual_seed(3)
    a, b, scalings = _slots(gen)
    x = torch.randn(4, IN, generator=gen)
    y = torch.randn(4, OUT + 24, generator=gen)
    got = add_lora(y.clone(), x, a, b, scalings, [Segment(1, 3, 1)], out_offset=12)
    row_slots = torch.tensor([-1, 1, 1, 1])
    want = y.double().clone()
    want[:, 12 : 12 + OUT] += _reference(x, a, b, scalings, row_slots)
    assert torch.equal(got[:, :12], y[:, :12]) and torch.equal(got[:, 12 + OUT :], y[:, 12 + OUT :])
    bound = _bound(x, a, b, scalings, row_slots) + 1e-6 * y[:, 12 : 12 + OUT].abs().double()
    assert ((got[:, 12 : 12 + OUT].double() - want[:, 12 : 12 + OUT]).abs() <= bound).all()


def test_bfloat16_output_within_its_rounding():
    gen = torch.Generator().manual_seed(4)
    a, b, scalings = _slots(gen)
    x = torch.randn(6, IN, generator=gen).bfloat16()
    base = torch.randn(6, OUT, generator=gen).bfloat16()
    row_slots = torch.tensor([0, 0, 2, 2, 2, -1])
    y = add_lora(base.clone(), x, a.bfloat16(), b.bfloat16(), scalings, lora_segments(row_slots))
    delta = _reference(x.float(), a.bfloat16().float(), b.bfloat16().float(), scalings, row_slots)
    want = base.double() + delta
    assert y.dtype == torch.bfloat16
    # the update rounded to bfloat16 (half an ulp: 2^-8 of it), then the sum (2^-8 of that)
    assert ((y.double() - want).abs() <= 2.0**-8 * (delta.abs() + want.abs()) * 1.01 + 1e-6).all()


def test_shapes_that_disagree_are_refused():
    a, b, scalings = _slots(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="disagree"):
        add_lora(torch.zeros(2, OUT), torch.zeros(2, IN + 1), a, b, scalings, [Segment(0, 2, 0)])
    with pytest.raises(ValueError, match="outside y's"):
        add_lora(torch.zeros(2, OUT), torch.zeros(2, IN), a, b, scalings, [Segment(0, 2, 0)], out_offset=1)


# ---- the compiled CPU kernel (csrc/lora_cpu.cpp): every segment of a part in one call ----


def _kernels():
    from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

    k = cpu_kernels.load()
    if k is None or not getattr(k, "has_avx2", False):
        pytest.skip("the CPU kernels are not built here")
    return k


def _table(segments: list[Segment]) -> torch.Tensor:
    return torch.tensor([(s.start, s.length, s.slot) for s in segments], dtype=torch.long).reshape(-1, 3)


@pytest.mark.parametrize("rank, width", [(16, 1536), (32, 64), (8, 40), (16, 40)])  # fast path; generic tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_equals_add_lora(rank, width, dtype):
    k, gen = _kernels(), torch.Generator().manual_seed(rank + width)
    t, slots = 45, 5
    a = (torch.randn(slots, IN, rank, generator=gen) * 0.2).to(dtype)
    b = (torch.randn(slots, rank, width, generator=gen) * 0.2).to(dtype)
    a[1, :, rank // 2 :] = 0  # a smaller adapter padded to the slots' rank
    b[1, rank // 2 :] = 0
    scalings = torch.rand(slots, generator=gen) + 0.5
    # Segments of 1..19 rows (past the kernel's 8-row items), base rows between, slot 3 unused.
    row_slots = torch.tensor([0] * 19 + [NO_LORA] * 3 + [2] + [4] * 9 + [NO_LORA] + [1] * 12)
    segments = lora_segments(row_slots)
    x = torch.randn(t, IN + 7, generator=gen)[:, 3 : 3 + IN]  # rows with a stride wider than IN
    y = torch.randn(t, width + 24, generator=gen)
    want, got = y.clone(), y.clone()
    add_lora(want, x, a, b, scalings, segments, out_offset=10)
    k.lora_add(got, x, a, b, scalings, _table(segments), 10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :10], y[:, :10]) and torch.equal(got[:, 10 + width :], y[:, 10 + width :])
    assert torch.equal(got[19:22], y[19:22]) and torch.equal(got[32], y[32])  # base rows untouched


def test_the_cpu_kernel_refuses_what_it_cannot_take():
    k = _kernels()
    a, b, scalings = torch.zeros(2, IN, 16), torch.zeros(2, 16, OUT), torch.ones(2)
    x, y = torch.zeros(4, IN), torch.zeros(4, OUT)
    with pytest.raises(RuntimeError, match="outside x or the slots"):
        k.lora_add(y, x, a, b, scalings, torch.tensor([[0, 4, 2]]), 0)
    with pytest.raises(RuntimeError, match="outside y"):
        k.lora_add(y, x, a, b, scalings, torch.tensor([[0, 4, 1]]), 1)
    with pytest.raises(RuntimeError, match="float32"):
        k.lora_add(y.double(), x.double(), a, b, scalings, torch.tensor([[0, 4, 1]]), 0)
