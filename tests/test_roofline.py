"""The roofline loops (csrc/roofline.cpp) do the arithmetic they claim,
checked against a float64 / integer reference of the same operands on every
path this CPU runs; paths it lacks are reported absent, never run; and a
run's share of its arithmetic's peak (benchmarks/roofline.py). No timing
is asserted beyond a rate being positive."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.benchmarks import roofline
from shoal.workers.model_executor.platforms.cpu import roofline_kernels


@pytest.fixture(scope="module")
def kernel():
    k = roofline_kernels.load()
    if k is None:
        pytest.skip("the roofline kernels do not build here")
    return k


# The operands of csrc/roofline.cpp: a (unsigned, 1..4) and b variant v (signed, -3..3), by flat index j.
def operand_a(j):
    return j % 4 + 1


def operand_b(j, v):
    return (j + 3 * v) % 7 - 3


def vector_sum(elems: int, lanes: int, accumulators: int, slots: int | None = None, scale: float = 1.0) -> float:
    """The checksum after one loop trip of a SIMD path: product k (of `accumulators`) multiplies a by b
    variant k % 2 over `elems` elements and adds each lane's elems / lanes products (4 for int8, 2 for
    bfloat16) into lane l of accumulator k % slots; the checksum weights lane l of accumulator s by
    s * lanes + l + 1."""
    slots = slots or accumulators
    group = elems // lanes
    total = 0.0
    for k in range(accumulators):
        for lane in range(lanes):
            value = sum(operand_a(j) * operand_b(j, k % 2) for j in range(lane * group, (lane + 1) * group))
            total += ((k % slots) * lanes + lane + 1) * value
    return scale * total


def amx_sum(k_per_row: int, group: int, scale: float = 1.0) -> float:
    """The checksum after one trip of the AMX loops: C0..C3 += A x B0, A x B1, A x B0, A x B1, with A 16
    rows of k_per_row (row-major) and each B tile in the VNNI layout (tile row r, element c is
    B[group * r + c % group][c // group]); element j of tile t weighted by t * 256 + j + 1."""
    a = np.array([[operand_a(m * k_per_row + k) for k in range(k_per_row)] for m in range(16)], dtype=np.float64)
    total = 0.0
    for t, v in enumerate((0, 1, 0, 1)):
        tile = np.array([operand_b(j, v) for j in range(16 * k_per_row)], dtype=np.float64).reshape(16, k_per_row)
        b = np.zeros((k_per_row, 16))
        for r in range(16):
            for c in range(k_per_row):
                b[group * r + c % group, c // group] = tile[r, c]
        total += float(((a @ b).ravel() * np.arange(t * 256 + 1, t * 256 + 257)).sum())
    return scale * total


# path: its checksum after one loop trip of one thread
ONE_TRIP = {
    "avx2-fma": vector_sum(8, 8, 12, scale=0.5 * 0.25),
    "avx512-fma": vector_sum(16, 16, 16, scale=0.5 * 0.25),
    "avx2-maddubs": vector_sum(32, 8, 8, slots=4),  # 8 products a trip into 4 accumulators
    "avxvnni-dpbusd": vector_sum(32, 8, 12),
    "avx512vnni-dpbusd": vector_sum(64, 16, 16),
    "avx512bf16-dpbf16": vector_sum(32, 16, 16, scale=0.5 * 0.25),
    "amx-bf16": amx_sum(32, 2, 0.5 * 0.25),
    "amx-int8": amx_sum(64, 4),
}


def test_every_path_is_listed_with_its_arithmetic_and_ops(kernel):
    paths = {p["name"]: p for p in kernel.paths()}
    assert set(paths) == set(ONE_TRIP)
    assert {p["arithmetic"] for p in paths.values()} == set(roofline.ARITHMETICS)
    for p in paths.values():
        assert p["ops_per_iter"] > 0 and p["instruction"]
        assert p["present"] == (p["absent"] == "")


@pytest.mark.parametrize("name", list(ONE_TRIP))
@pytest.mark.parametrize("iters", [0, 1, 7, 1000])
def test_each_path_does_the_multiply_adds_it_claims(kernel, name, iters):
    path = next(p for p in kernel.paths() if p["name"] == name)
    if not path["present"]:
        pytest.skip(f"{name} is absent here: {path['absent']}")
    for threads in (1, 2):
        sums, cpu_s = kernel.run(name, iters, threads)
        assert sums == [iters * ONE_TRIP[name]] * threads  # exact: small values, sums within the mantissa
        assert len(cpu_s) == threads and all(c >= 0 for c in cpu_s)


def test_the_reference_tells_a_wrong_loop_from_the_right_one():
    """Against which the checks above would fail: one b for all accumulators, no multiply (a = 1),
    lanes summed in another grouping, or each product in its own accumulator."""
    right = ONE_TRIP["avx2-maddubs"]
    one_b = sum(
        (k % 4 * 8 + lane + 1) * sum(operand_a(j) * operand_b(j, 0) for j in range(4 * lane, 4 * lane + 4))
        for k in range(8)
        for lane in range(8)
    )
    no_multiply = sum(
        (k % 4 * 8 + lane + 1) * sum(operand_b(j, k % 2) for j in range(4 * lane, 4 * lane + 4))
        for k in range(8)
        for lane in range(8)
    )
    assert len({right, one_b, no_multiply, vector_sum(32, 16, 8, slots=4), vector_sum(32, 8, 8)}) == 5


def test_an_absent_path_is_refused_not_run(kernel):
    absent = [p for p in kernel.paths() if not p["present"]]
    if not absent:
        pytest.skip("this CPU has every path")
    for p in absent:
        assert p["absent"]
        with pytest.raises(ValueError, match=f"'{p['name']}' is absent here: {p['absent']}"):
            kernel.run(p["name"], 10, 1)
    with pytest.raises(ValueError, match="unknown roofline path"):
        kernel.run("avx9-fma", 10, 1)


def test_rooflines_give_each_arithmetic_its_fastest_present_path(kernel):
    roofs = roofline.measure_rooflines(
        threads=1, seconds=0.03, achieved={"float32": {"ops_s": 1.0, "wall_ops_s": 1.0, "by": "a slow GEMM"}}
    )
    assert list(roofs) == list(roofline.ARITHMETICS)
    present = {p["name"]: p for p in kernel.paths() if p["present"]}
    for e in roofs.values():
        assert e["threads"] == 1
        rates = {n: p["ops_s"] for n, p in e["paths"].items() if n in present}
        assert all(r > 0 for r in rates.values())
        assert all(e["paths"][n]["wall_ops_s"] > 0 for n in rates)
        if rates:
            assert e["ops_s"] == max(rates.values()) and e["path"] in rates
            assert e["instruction"] == present[e["path"]]["instruction"]
        else:  # every path of this arithmetic absent: said so, with why
            assert e["ops_s"] is None and e["absent"]
            assert all(p["absent"] for p in e["paths"].values())
    assert roofs["float32"]["achieved"]["by"] == "a slow GEMM"
    text = roofline.format_rooflines(roofs, every_path=True)
    for arith in roofline.ARITHMETICS:
        assert arith in text


def test_without_the_kernels_every_arithmetic_is_absent_and_a_gemm_stands_in(monkeypatch):
    monkeypatch.setattr(roofline_kernels, "load", lambda: None)
    gemm = {"ops_s": 5e10, "wall_ops_s": 4e10, "by": "MKL"}
    roofs = roofline.measure_rooflines(threads=2, achieved={"float32": gemm, "int8": {"ops_s": None}})
    assert roofs["float32"] | {"paths": None} == {
        "threads": 2,
        "paths": None,
        "achieved": gemm,
        "ops_s": 5e10,
        "wall_ops_s": 4e10,
        "path": "achieved",
        "instruction": "MKL",
    }
    assert "achieved" not in roofs["int8"]
    for arith in ("int8", "bfloat16"):
        assert roofs[arith]["ops_s"] is None and "could not be built" in roofs[arith]["absent"]
    assert "absent" in roofline.format_rooflines(roofs)


ROOFS = {
    "float32": {"ops_s": 1e11, "instruction": "vfmadd231ps ymm"},
    "int8": {"ops_s": 4e11, "instruction": "vpdpbusd zmm"},
    "bfloat16": {"ops_s": None, "instruction": None, "absent": "no AVX512-BF16"},
}


@pytest.mark.parametrize(
    "result, arithmetic, against",
    [
        ({"quantization": "gguf"}, "int8", "int8"),  # no compute_dtype: derived from the quantization
        ({"quantization": "int8"}, "int8", "int8"),
        ({"quantization": "none"}, "float32", "float32"),
        ({}, "float32", "float32"),
        ({"quantization": "none", "compute_dtype": "int8"}, "int8", "int8"),  # compute_dtype wins
        ({"compute_dtype": "torch.float32"}, "float32", "float32"),
        ({"compute_dtype": "bf16"}, "bfloat16", "float32"),  # no bfloat16 peak here: against float32's
        ({"compute_dtype": "fp8"}, "fp8", "float32"),
    ],
)
def test_a_run_is_measured_against_its_arithmetics_peak(result, arithmetic, against):
    result = result | {"seconds": 2.0}
    share = roofline.roofline_share(result, 1e11, ROOFS)
    assert share["arithmetic"] == arithmetic and share["against"] == against
    assert share["peak_ops_s"] == ROOFS[against]["ops_s"]
    assert share["fraction"] == pytest.approx(1e11 / 2.0 / ROOFS[against]["ops_s"])
    label = roofline.format_share(share)
    assert label.startswith(f"{100 * share['fraction']:.1f}% {arithmetic}")
    assert ("vs float32" in label) == (against != arithmetic)


def test_bfloat16_runs_use_the_bfloat16_peak_where_there_is_one():
    roofs = ROOFS | {"bfloat16": {"ops_s": 2e11, "instruction": "vdpbf16ps zmm"}}
    share = roofline.roofline_share({"compute_dtype": "bfloat16", "seconds": 1.0}, 1e11, roofs)
    assert share == {
        "arithmetic": "bfloat16",
        "against": "bfloat16",
        "peak_ops_s": 2e11,
        "instruction": "vdpbf16ps zmm",
        "fraction": 0.5,
    }
    # no peak at all (no kernels, no GEMM measured): no share, and no crash
    none = roofline.roofline_share({"seconds": 1.0}, 1e11, {})
    assert none["fraction"] is None and roofline.format_share(none) == "- float32"
