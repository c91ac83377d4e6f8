"""The grouped LoRA update's Triton kernels (workers/lora/triton_ops.py), run
by Triton's interpreter on the CPU, against ops.add_lora over the segments of
the same per-row slots: mixed batches of base rows and several slots, one
slot's rows apart, slots with no rows, adapters of rank 4 and 8 padded to
R = 16, the three parts of a fused qkv written into one wider y, strided x
and y, T = 1 and T past one tile, float32 / float16 / bfloat16, the split
shrink; and launches that follow the shapes alone. On CUDA (marked gpu) the
compiled kernels, also replayed from a captured CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys

# Triton picks interpreted or compiled when a kernel is decorated: before triton is first
# imported. The CUDA check below reruns this file in a process that compiles (SHOAL_TRITON_COMPILED=1).
if not os.environ.get("SHOAL_TRITON_COMPILED"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the LoRA Triton kernel tests need the triton package")

from shoal.workers.lora import triton_ops
from shoal.workers.lora.ops import NO_LORA, add_lora, lora_segments
from shoal.workers.lora.triton_ops import add_lora_triton, shrink_split_k

IN, OUT, MAX_RANK = 48, 40, 16
RANKS = (4, 8, 16, 8)  # slot s holds an adapter of rank RANKS[s], zero past it
SCALINGS = (0.5, 2.0, 1.0 / 3.0, 1.5)
# Half an ulp of each dtype: the bound on one rounding, relative.
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

interpreted_only = pytest.mark.skipif(
    not triton_ops.interpreted(), reason="runs CPU tensors: needs TRITON_INTERPRET=1 before triton's import"
)


def _slots(gen, ranks=RANKS, in_features=IN, out=OUT, max_rank=MAX_RANK, dtype=torch.float32):
    """A [slots, in, R] and B [slots, R, out] of adapters of the given ranks, zero past each rank."""
    a = torch.zeros(len(ranks), in_features, max_rank)
    b = torch.zeros(len(ranks), max_rank, out)
    for s, r in enumerate(ranks):
        a[s, :, :r] = torch.randn(in_features, r, generator=gen)
        b[s, :r] = torch.randn(r, out, generator=gen) * 0.5
    return a.to(dtype), b.to(dtype), torch.tensor(SCALINGS[: len(ranks)], dtype=torch.float32)


def _runs(gen, total, num_slots):
    """Row slots in runs of random length over the base and every slot, cut to total rows."""
    row_slots: list[int] = []
    while len(row_slots) < total:
        row_slots += [int(torch.randint(-1, num_slots, (1,), generator=gen))] * int(
            torch.randint(1, 9, (1,), generator=gen)
        )
    return torch.tensor(row_slots[:total], dtype=torch.long)


def _reference(y, x, a, b, scalings, row_slots, out_offset=0):
    return add_lora(y.clone(), x, a, b, scalings, lora_segments(row_slots), out_offset)


def _bound(y, x, a, b, scalings, row_slots, dtype):
    """What the two computations may differ by, element by element: float32
    sums in another order (ulps of the sums of |terms|); for a 16-bit y, the
    kernel's rounding of the shrunk values to it before the expand, and in
    each of the two, one rounding of the update and one of the sum. (Triton's
    interpreter casts float32 to bfloat16 by truncation, a whole ulp, where
    the GPU rounds to nearest.)"""
    x64, a64, b64 = x.double(), a.double(), b.double()
    out = torch.zeros(y.shape, dtype=torch.float64)
    eps32 = torch.finfo(torch.float32).eps
    for i, s in enumerate(row_slots.tolist()):
        if s == NO_LORA:
            continue
        scale = abs(float(scalings[s]))
        shrunk = x64[i] @ a64[s]
        delta = (shrunk @ b64[s]) * scale
        terms = (x64[i].abs() @ a64[s].abs()) @ b64[s].abs() * scale
        out[i] = terms * (x.shape[1] + a.shape[2] + 8) * eps32
        if dtype != torch.float32:
            u = HALF_ULP[dtype]  # torch's roundings
            uk = 2 * u if dtype == torch.bfloat16 and triton_ops.interpreted() else u  # the kernel's
            out[i] += uk * (shrunk.abs() * scale) @ b64[s].abs() + (u + uk) * (
                delta.abs() + (y[i].double() + delta).abs()
            )
    return out * 1.05 + 1e-6


def _check(got, want, y, x, a, b, scalings, row_slots, dtype):
    assert got.dtype == want.dtype == y.dtype
    err = (got.double() - want.double()).abs()
    bound = _bound(y, x, a, b, scalings, row_slots, dtype)
    assert (err <= bound).all(), f"max error {err.max():.3g}, excess {(err - bound).max():.3g}"
    base = row_slots == NO_LORA
    assert torch.equal(got[base], y[base]), "a base row changed"


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "pattern",
    [
        [0, 0, -1, 2, 2, 0, -1],  # slot 0's rows apart, slots 1 and 3 with no rows
        [1],  # T = 1
        [-1, 3, 3, 3, 1, 0, -1, -1, 2, 2, 2, 2, 3, 0, 0, 1, 1, 1, 1, -1],  # every slot; T = 20, one 32-row tile
    ],
    ids=["mixed", "one-row", "all-slots"],
)
def test_equals_add_lora_on_its_segments(pattern, dtype):
    gen = torch.Generator().manual_seed(len(pattern))
    a, b, scalings = _slots(gen, dtype=dtype)
    row_slots = torch.tensor(pattern, dtype=torch.int32)
    x = torch.randn(len(pattern), IN, generator=gen).to(dtype)
    y = torch.randn(len(pattern), OUT, generator=gen).to(dtype)
    got = add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
    want = _reference(y, x, a, b, scalings, row_slots)
    _check(got, want, y, x, a, b, scalings, row_slots, dtype)
    assert not torch.equal(got, y)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_one_tile_and_a_short_last_tile(dtype):
    """T = 70: two 64-row tiles, the second 6 rows long; runs cross the tile boundary."""
    gen = torch.Generator().manual_seed(70)
    a, b, scalings = _slots(gen, dtype=dtype)
    row_slots = _runs(gen, 70, len(RANKS))
    row_slots[60:68] = 2  # a run across the boundary at row 64
    x = torch.randn(70, IN, generator=gen).to(dtype)
    y = torch.randn(70, OUT, generator=gen).to(dtype)
    got = add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
    _check(got, _reference(y, x, a, b, scalings, row_slots), y, x, a, b, scalings, row_slots, dtype)


@interpreted_only
def test_float32_within_1e_5_relative():
    gen = torch.Generator().manual_seed(11)
    a, b, scalings = _slots(gen)
    row_slots = torch.tensor([0, 0, -1, 2, 2, 0, -1, 1, 3, 3])
    x, y = torch.randn(10, IN, generator=gen), torch.randn(10, OUT, generator=gen)
    got = add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
    want = _reference(y, x, a, b, scalings, row_slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_base_rows_leave_y_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(2)
    a, b, scalings = _slots(gen, dtype=dtype)
    x = torch.randn(9, IN, generator=gen).to(dtype)
    y = torch.randn(9, OUT + 8, generator=gen).to(dtype)
    y[0, 0] = float("nan")  # not even read
    for row_slots in (torch.full((9,), NO_LORA), torch.full((9,), NO_LORA, dtype=torch.int32)):
        got = y.clone()
        assert add_lora_triton(got, x, a, b, scalings, row_slots, out_offset=8) is got
        assert torch.equal(got.view(torch.uint8), y.view(torch.uint8))  # bits: the NaN too
    # no rows at all
    empty = torch.zeros(0, OUT, dtype=dtype)
    assert add_lora_triton(empty, x[:0], a, b, scalings, torch.zeros(0, dtype=torch.long)).shape == (0, OUT)


@interpreted_only
def test_padding_the_rank_changes_nothing():
    """Rank-4 and rank-8 adapters in R = 16 slots give what the same adapters
    unpadded give (R = 4 and 8 themselves: rank blocks mostly masked)."""
    gen = torch.Generator().manual_seed(7)
    a, b, scalings = _slots(gen, ranks=(4, 8))
    x, y = torch.randn(6, IN, generator=gen), torch.randn(6, OUT, generator=gen)
    row_slots = torch.tensor([0, 0, 1, -1, 1, 0])
    padded = add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
    for s, r in ((0, 4), (1, 8)):
        rows = row_slots == s
        exact = add_lora_triton(
            y[rows].clone(),
            x[rows],
            a[s : s + 1, :, :r],
            b[s : s + 1, :r],
            scalings[s : s + 1],
            torch.zeros(int(rows.sum()), dtype=torch.long),
        )
        torch.testing.assert_close(padded[rows], exact, rtol=1e-6, atol=1e-5)
    assert torch.equal(padded[row_slots == NO_LORA], y[row_slots == NO_LORA])


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_parts_of_a_fused_qkv_land_in_their_columns(dtype):
    """q (32 columns), k and v (16 each) into one y of 64 + 8 columns, each
    part's own slots; the last 8 columns untouched. y is column-major (a
    transposed view) and x a slice of a wider tensor: strides, not copies."""
    gen = torch.Generator().manual_seed(5)
    widths, offsets = (32, 16, 16), (0, 32, 48)
    parts = [_slots(gen, out=w, dtype=dtype) for w in widths]
    row_slots = torch.tensor([2, 2, -1, 0, 0, 3, -1, 1, 2])
    t = len(row_slots)
    x = torch.randn(t, IN + 10, generator=gen).to(dtype)[:, 5 : 5 + IN]
    y = torch.randn(72, t, generator=gen).to(dtype).t()
    assert x.stride() == (IN + 10, 1) and y.stride() == (1, t)
    got, want = y.clone(memory_format=torch.preserve_format), y.clone()
    assert got.stride() == y.stride()
    for (a, b, scalings), off in zip(parts, offsets):
        add_lora_triton(got, x, a, b, scalings, row_slots, out_offset=off)
        add_lora(want, x, a, b, scalings, lora_segments(row_slots), off)
    for (a, b, scalings), off, w in zip(parts, offsets, widths):
        cols = slice(off, off + w)
        _check(got[:, cols], want[:, cols], y[:, cols], x, a, b, scalings, row_slots, dtype)
    assert torch.equal(got[:, 64:], y[:, 64:])


@interpreted_only
def test_float32_model_with_bfloat16_slots():
    """--lora-dtype bfloat16 under a float32 model: the slots' values widened, products in float32."""
    gen = torch.Generator().manual_seed(9)
    a, b, scalings = _slots(gen, dtype=torch.bfloat16)
    row_slots = torch.tensor([1, 1, -1, 0, 3])
    x, y = torch.randn(5, IN, generator=gen), torch.randn(5, OUT, generator=gen)
    got = add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
    _check(got, _reference(y, x, a, b, scalings, row_slots), y, x, a, b, scalings, row_slots, torch.float32)


@interpreted_only
def test_split_shrink_equals_the_single_pass():
    """in = 160 features (three 64-feature chunks): a small step splits them in two, summed atomically."""
    gen = torch.Generator().manual_seed(3)
    a, b, scalings = _slots(gen, in_features=160)
    row_slots = torch.tensor([0, -1, 2, 2, 1])
    x, y = torch.randn(5, 160, generator=gen), torch.randn(5, OUT, generator=gen)
    assert shrink_split_k(5, 160, MAX_RANK) == 2 and shrink_split_k(5, IN, MAX_RANK) == 1
    assert shrink_split_k(16384, 4096, MAX_RANK) == 1  # 256 tiles of 64 rows: a long prefill fills the GPU as it is
    want = _reference(y, x, a, b, scalings, row_slots)
    for split_k in (None, 1, 4):
        got = add_lora_triton(y.clone(), x, a, b, scalings, row_slots, split_k=split_k)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@interpreted_only
def test_launches_follow_the_shapes_not_the_slots(monkeypatch):
    """One launch of each kernel, its grid from T, in, out and R alone: the
    same for a step of one adapter, of four, and of none (a CUDA graph
    captured for one replays the others)."""
    grids: list[tuple[str, tuple]] = []
    for name in ("_shrink_kernel", "_expand_kernel"):
        kernel = getattr(triton_ops, name)

        class Spy:
            def __getitem__(self, grid, _kernel=kernel, _name=name):
                grids.append((_name, grid))
                return _kernel[grid]

        monkeypatch.setattr(triton_ops, name, Spy())
    gen = torch.Generator().manual_seed(1)
    a, b, scalings = _slots(gen)
    x, y = torch.randn(12, IN, generator=gen), torch.randn(12, OUT, generator=gen)
    seen = []
    for row_slots in (torch.zeros(12, dtype=torch.long), _runs(gen, 12, 4), torch.full((12,), NO_LORA)):
        grids.clear()
        add_lora_triton(y.clone(), x, a, b, scalings, row_slots)
        seen.append(list(grids))
    assert seen[0] == seen[1] == seen[2] == [("_shrink_kernel", (1, 1, 1)), ("_expand_kernel", (1, 1))]


def test_disagreeing_arguments_are_refused():
    a, b, scalings = _slots(torch.Generator().manual_seed(0))
    x, y, rows = torch.zeros(2, IN), torch.zeros(2, OUT), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="disagree"):
        add_lora_triton(y, torch.zeros(2, IN + 1), a, b, scalings, rows)
    with pytest.raises(ValueError, match="outside y's"):
        add_lora_triton(y, x, a, b, scalings, rows, out_offset=1)
    with pytest.raises(ValueError, match="row_slots"):
        add_lora_triton(y, x, a, b, scalings, rows.float())
    with pytest.raises(ValueError, match="row_slots"):
        add_lora_triton(y, x, a, b, scalings, rows[:1])
    with pytest.raises(ValueError, match="disagree"):
        add_lora_triton(y, x, a, b[:, :8], scalings, rows)


# ---- on CUDA only (the GPU check, scripts/gpu_check.py): the compiled kernels ----


def cuda(test):
    """CUDA only: the GPU check runs these, as -m gpu."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@cuda
def test_cuda_checks_compiled():
    """The test_cuda_ tests of this file in a process where Triton compiles."""
    if not triton_ops.interpreted():
        pytest.skip("this process compiles: the test_cuda_ tests ran here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"SHOAL_TRITON_COMPILED": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "test_cuda_ and not checks_compiled",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-4000:]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_compiled_equals_add_lora_and_replays_from_a_graph(dtype):
    if triton_ops.interpreted():
        pytest.skip("Triton interprets in this process: test_cuda_checks_compiled runs this")
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(17)
    in_features, t = 1024, 300
    widths, offsets = (512, 128, 128), (0, 512, 640)
    parts = [_slots(gen, in_features=in_features, out=w, dtype=dtype) for w in widths]
    x = torch.randn(t, in_features, generator=gen).to(dtype)
    y = torch.randn(t, 800, generator=gen).to(dtype)
    steps = [_runs(gen, t, 4) for _ in range(3)] + [torch.full((t,), NO_LORA)]

    def reference(row_slots):
        want = y.clone()
        for (a, b, scalings), off in zip(parts, offsets):
            add_lora(want, x, a, b, scalings, lora_segments(row_slots), off)
        return want

    on = [(a.to(dev), b.to(dev), s.to(dev)) for a, b, s in parts]
    x_d, y_d = x.to(dev), y.to(dev)
    slots_d = steps[0].to(dev, torch.int32)
    static_y = y_d.clone()

    def step():
        for (a, b, scalings), off in zip(on, offsets):
            add_lora_triton(static_y, x_d, a, b, scalings, slots_d, out_offset=off)

    def check(got, row_slots):
        assert torch.equal(got[row_slots == NO_LORA], y[row_slots == NO_LORA])
        want = reference(row_slots)
        for (a, b, scalings), off, w in zip(parts, offsets, widths):
            cols = slice(off, off + w)
            err = (got[:, cols].double() - want[:, cols].double()).abs()
            bound = _bound(y[:, cols], x, a, b, scalings, row_slots, dtype)
            assert (err <= bound).all(), f"{dtype} part at {off}: max error {err.max():.3g}"

    step()  # compiles; eager, with no host sync in it
    torch.cuda.synchronize()
    check(static_y.cpu(), steps[0])
    torch.cuda.set_sync_debug_mode("error")
    try:
        static_y.copy_(y_d)
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for row_slots in steps[1:]:  # new slots in place, the same launches replayed
        slots_d.copy_(row_slots.to(dev, torch.int32))
        static_y.copy_(y_d)
        graph.replay()
        torch.cuda.synchronize()
        check(static_y.cpu(), row_slots)
