"""A pytest plugin (`-p triton_compile_only`) that compiles, for a Hopper GPU
(sm_90), every Triton kernel launch the interpreter tests make, with no GPU:
Triton's active driver is replaced by one that reports an H200 (its shared
memory, 32-thread warps), compiles each launch through Triton's whole
pipeline to a cubin (ptxas included), checks it against the device's limits
as a real launch would, and then launches nothing. The wrappers' guards that
keep CPU tensors away from compiled kernels are lifted, so the same calls
reach the compiler. Outputs are whatever the buffers held: the tests'
numerical assertions fail, and only errors raised by Triton count (see
test_triton_compile.py). Must load before any kernel module is imported."""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, decided when triton decorates them

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import shoal.workers.lora.triton_ops as lora_ops  # noqa: E402
import shoal.workers.model_executor.layers.attention.triton_kernels as attention_kernels  # noqa: E402
import shoal.workers.model_executor.layers.fused_moe.triton_kernels as fused_moe  # noqa: E402
import shoal.workers.model_executor.layers.fused_ops as fused_ops  # noqa: E402
import shoal.workers.model_executor.layers.quantization.triton_quant as triton_quant  # noqa: E402

MODULES = (lora_ops, fused_moe, fused_ops, triton_quant, attention_kernels)
H200 = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}
MAX_THREADS = 1024
launched: set[str] = set()
triton_errors: list[str] = []


class _Utils:
    def get_device_properties(self, device):
        return H200

    def load_binary(self, name, kernel, shared, device):
        assert isinstance(kernel, bytes) and kernel, f"{name}: no cubin"
        return None, None, 0, 0, MAX_THREADS


class _NoLaunch:
    def __init__(self, src, metadata):
        self.name = getattr(src, "name", str(src))

    def __call__(self, *args, **kwargs):
        launched.add(self.name)


class CompileOnlyDriver:
    """Triton's driver interface, as far as compiling a launch reads it."""

    utils = _Utils()
    launcher_cls = _NoLaunch

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def kernels() -> list[str]:
    """Every jitted kernel of MODULES (helpers called from kernels included)."""
    return sorted(name for m in MODULES for name, v in vars(m).items() if isinstance(v, JITFunction))


driver.set_active(CompileOnlyDriver())
_interpreted = lora_ops.interpreted
lora_ops.interpreted = lambda: True  # the LoRA tests' skipif reads it while they are collected
lora_ops.available_for = lambda x: True
triton_quant.interpreted = lambda: True
triton_quant._on_triton = lambda x: True
attention_kernels._check_runs_on = lambda device: None
fused_ops._check_runs_on = lambda x: None


def pytest_collection_finish(session):
    lora_ops.interpreted = _interpreted  # from here the native paths, not the interpreter's upcast ones


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except Exception as e:
        if type(e).__module__.startswith("triton"):
            triton_errors.append(f"{item.nodeid}: {type(e).__name__}: {str(e)[:2000]}")
        raise


def pytest_sessionfinish(session):
    print(f"\nCOMPILED {' '.join(sorted(launched))}")
    print(f"KERNELS {' '.join(kernels())}")
    for line in triton_errors:
        print(f"TRITON_ERROR {line}")
