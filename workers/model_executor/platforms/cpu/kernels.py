"""The compiled CPU kernels (csrc/): decode attention straight from the
paged KV cache, and the few-row linear layer of a decode step.

Built once with torch's extension loader into ~/.cache/shoal/kernels/
shoal_cpu_kernels-<hash of sources and flags> under a lock that a killed
build cannot leave stuck (kernel_build.py; `make install` builds it ahead).
load() returns None where it cannot be built (no compiler, an unusual
platform): the pure-torch path then runs, and it stays the reference either
way. Another process's build outlasting SHOAL_KERNEL_BUILD_TIMEOUT is an
error naming the lock and its owner (KernelBuildTimeout): something is
wrong on that machine, and a start that quietly ran several times slower
would hide it. The engine loads it only under
EngineArgs.cpu_kernels (off: --no-cpu-kernels, or $SHOAL_CPU_KERNEL=0), when
the cpu_kernel attention backend is chosen; bind.py is then the one place
the kernels reach the other layers.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)
_kernel = None
_tried = False
_SOURCES = (
    "bindings.cpp",
    "paged_decode_cpu.cpp",
    "paged_prefill_cpu.cpp",
    "cpu_gemm.cpp",
    "cpu_ops.cpp",
    "cpu_decode_layers.cpp",
    "gguf_gemv.cpp",
    "gguf_kquants.cpp",
    "int8_gemm.cpp",
    "lora_cpu.cpp",
)


def load():
    global _kernel, _tried
    if _tried:
        return _kernel
    from shoal.workers.model_executor.platforms.cpu.kernel_build import KernelBuildTimeout, load_extension

    try:
        t0 = time.perf_counter()
        csrc = os.path.join(os.path.dirname(__file__), "csrc")
        _kernel = load_extension(
            "shoal_cpu_kernels",
            [os.path.join(csrc, s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - t0)
    except KernelBuildTimeout:
        raise  # not remembered: a later call waits again
    except Exception as e:  # no compiler or ninja, an unusual platform
        logger.warning("CPU kernels unavailable (%s); using the torch path", e)
        _kernel = None
    _tried = True
    return _kernel
