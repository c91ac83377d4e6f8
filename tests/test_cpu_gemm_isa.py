"""The few-row matmul of the CPU kernels (csrc/cpu_gemm.cpp) in each of its
builds: AVX2 and, where the CPU has AVX-512F, AVX-512. Each against a
float64 reference, float32 and bfloat16 weights, and the two against each
other; set_isa and SHOAL_CPU_ISA choose between them."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build (is a C++ compiler installed? a compiler error in the log?)"
    if not k.has_avx2:
        pytest.skip("built without AVX2: no small_m_linear")
    return k


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, kernel):
    if request.param == "avx512" and not kernel.has_avx512:
        pytest.skip("this CPU (or build) has no AVX-512F")
    previous = kernel.set_isa(request.param)
    assert kernel.get_isa() == request.param
    yield request.param
    kernel.set_isa(previous)


# K: one 16-wide step, the AVX-512 one-row loop's 64-wide steps with 16, 32
# and 48 left over, and SmolLM2's widths.
@pytest.mark.parametrize("K", [16, 48, 80, 96, 576, 1536])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_matches_float64_reference(kernel, isa, wdtype, K):
    gen = torch.Generator().manual_seed(K)
    for N in (1, 3, 4, 5, 131):
        w = torch.randn(N, K, generator=gen).to(wdtype)
        b = torch.randn(N, generator=gen)
        # M: the dot-product tiles' rows (1-4, 49), then the outer-product tiles' 16-row
        # panels whole and with 1 and 15 rows left over, up to matmul.MAX_KERNEL_ROWS.
        for M in (1, 2, 3, 4, 49, 16, 17, 31, 130, 256):
            x = torch.randn(M, K, generator=gen)
            ref = F.linear(x.double(), w.double(), b.double()).float()
            torch.testing.assert_close(
                kernel.small_m_linear(x, w, b),
                ref,
                rtol=1e-5,
                atol=1e-4 * math.sqrt(K),
                msg=lambda m: f"{isa} M={M} N={N} K={K} {wdtype}: {m}",
            )


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_m_linear_exact_on_integers(kernel, isa, wdtype):
    # Small integers (exact in bfloat16) whose sums stay below 2**24: every
    # product and partial sum is exact, so any order of the sums, and any
    # widening that loses nothing, gives the reference to the bit.
    gen = torch.Generator().manual_seed(7)
    K, N = 576, 67
    w = torch.randint(-8, 9, (N, K), generator=gen).float().to(wdtype)
    for M in (1, 2, 3, 8, 50):
        x = torch.randint(-8, 9, (M, K), generator=gen).float()
        ref = (x.double() @ w.double().T).float()
        assert torch.equal(kernel.small_m_linear(x, w, None), ref), f"{isa} M={M} {wdtype}"


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_grouped_small_m_linear_matches_float64_reference(kernel, isa, wdtype):
    gen = torch.Generator().manual_seed(3)
    E, N, K = 4, 37, 80
    w = torch.randn(E, N, K, generator=gen).to(wdtype)
    counts = [3, 0, 1, 6]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    x = torch.randn(sum(counts), K, generator=gen)
    y = kernel.grouped_small_m_linear(x, w, offsets)
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        ref = F.linear(x[rows].double(), w[e].double()).float()
        torch.testing.assert_close(y[rows], ref, rtol=1e-5, atol=1e-4 * math.sqrt(K))


def test_the_builds_agree(kernel):
    if not kernel.has_avx512:
        pytest.skip("this CPU (or build) has no AVX-512F")
    gen = torch.Generator().manual_seed(11)
    previous = kernel.get_isa()
    try:
        for wdtype in (torch.float32, torch.bfloat16):
            for N, K in ((1536, 576), (576, 1536)):
                w = torch.randn(N, K, generator=gen).to(wdtype)
                for M in (1, 3, 16):
                    x = torch.randn(M, K, generator=gen)
                    kernel.set_isa("avx2")
                    a = kernel.small_m_linear(x, w, None)
                    kernel.set_isa("avx512")
                    b = kernel.small_m_linear(x, w, None)
                    # the same exact products, summed in another order
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * math.sqrt(K))
    finally:
        kernel.set_isa(previous)


def test_set_isa(kernel):
    previous = kernel.get_isa()
    try:
        widest = "avx512" if kernel.has_avx512 else "avx2"
        kernel.set_isa("avx2")
        assert kernel.set_isa("auto") == "avx2"
        assert kernel.get_isa() == widest
        with pytest.raises(RuntimeError, match="expected 'auto', 'avx2' or 'avx512'"):
            kernel.set_isa("sse2")
        assert kernel.get_isa() == widest
        if not kernel.has_avx512:
            with pytest.raises(RuntimeError, match="no AVX-512 path"):
                kernel.set_isa("avx512")
    finally:
        kernel.set_isa(previous)


@pytest.mark.parametrize("value", ["avx2", "auto"])
def test_env_var_chooses_at_load(kernel, value):
    # A fresh process: the module reads SHOAL_CPU_ISA once, when it loads.
    code = "from shoal.workers.model_executor.platforms.cpu import kernels; print(kernels.load().get_isa())"
    env = {**os.environ, "SHOAL_CPU_ISA": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=True)
    expected = "avx2" if value == "avx2" or not kernel.has_avx512 else "avx512"
    assert out.stdout.strip().splitlines()[-1] == expected


# ---- the opt-in bfloat16 dot product (vdpbf16ps) ----------------------------


@pytest.mark.parametrize("K", [16, 48, 576, 1536])
def test_bf16dot_matches_bf16_rounded_reference(kernel, K):
    if not kernel.has_avx512_bf16:
        pytest.skip("this CPU (or build) has no AVX512_BF16")
    gen = torch.Generator().manual_seed(K + 1)
    for N in (1, 3, 4, 5, 131):
        w = torch.randn(N, K, generator=gen).bfloat16()
        b = torch.randn(N, generator=gen)
        for M in (1, 2, 3, 4, 49):
            x = torch.randn(M, K, generator=gen)
            # x rounded to bfloat16 (to nearest even), then exact products summed in float32
            ref = F.linear(x.bfloat16().double(), w.double(), b.double()).float()
            torch.testing.assert_close(
                kernel.small_m_linear_bf16dot(x, w, b),
                ref,
                rtol=1e-5,
                atol=1e-4 * math.sqrt(K),
                msg=lambda m: f"M={M} N={N} K={K}: {m}",
            )


def test_bf16dot_is_opt_in_and_bf16_weights_only(kernel):
    if not kernel.has_avx512_bf16:
        with pytest.raises(RuntimeError, match="built without AVX512_BF16"):
            kernel.small_m_linear_bf16dot(torch.randn(2, 32), torch.randn(8, 32).bfloat16(), None)
        return
    with pytest.raises(RuntimeError, match="bfloat16 weights only"):
        kernel.small_m_linear_bf16dot(torch.randn(2, 32), torch.randn(8, 32), None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.small_m_linear_bf16dot(torch.randn(2, 24), torch.randn(8, 24).bfloat16(), None)
    # small_m_linear keeps x in float32: on integers plus a fraction bfloat16 cannot hold, it stays exact
    x = torch.full((1, 32), 1.0 + 2.0**-10)
    w = torch.ones(8, 32).bfloat16()
    assert torch.equal(kernel.small_m_linear(x, w, None), torch.full((1, 8), 32 * (1.0 + 2.0**-10)))
    assert torch.equal(kernel.small_m_linear_bf16dot(x, w, None), torch.full((1, 8), 32.0))
