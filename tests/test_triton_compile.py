"""Every Triton kernel compiles for Hopper (sm_90), on the CPU: the
interpreter tests' own launches, rerun under tests/triton_compile_only.py,
go through Triton's whole pipeline to a cubin and the device's limits
(shared memory, threads) with no GPU. The interpreter checks the kernels'
arithmetic; this checks what only the compiler sees (types, layouts, tl.dot's
shapes, constexpr use, shared memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="compiling the kernels needs the triton package")
TESTS = os.path.dirname(os.path.abspath(__file__))
FILES = ("test_lora_triton.py", "test_triton_attention.py", "test_triton_quant.py", "test_fused_ops.py")
FILES += (
    "test_fused_moe.py",
    "test_kv_cache_fp8.py",
    "test_sliding_window.py::test_triton_kernels_equal_the_dense_reference",
)
# About two minutes with Triton's cache empty (some 140 specializations): the slow tier's.
pytestmark = pytest.mark.slow


def test_every_triton_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow"]
    argv += ["-p", "triton_compile_only", "--tb=no", *(os.path.join(TESTS, f) for f in FILES)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1500)
    out = done.stdout
    compiled = next((line.split()[1:] for line in out.splitlines() if line.startswith("COMPILED ")), None)
    kernels = next((line.split()[1:] for line in out.splitlines() if line.startswith("KERNELS ")), None)
    errors = [line for line in out.splitlines() if line.startswith("TRITON_ERROR ")]
    assert compiled is not None and kernels is not None, out[-4000:] + done.stderr[-4000:]
    assert not errors, "\n".join(errors)
    helpers = {"_rotate_heads", "_tile_slots"}  # called from kernels, never launched alone
    assert set(kernels) - helpers <= set(compiled), (kernels, compiled)
