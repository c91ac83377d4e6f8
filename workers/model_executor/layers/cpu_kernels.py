"""The compiled CPU kernels (csrc/): decode attention straight from the
paged KV cache, and the few-row linear layer of a decode step.

Built once with torch's extension loader and cached under
~/.cache/torch_extensions (`make install` builds it ahead). load() returns
None where it cannot be built (no compiler): the pure-torch path then runs,
and it stays the reference either way. The model runner calls it only under
EngineArgs.cpu_kernels (off: --no-cpu-kernels, or $SHOAL_CPU_KERNEL=0).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)
_kernel = None
_tried = False
_SOURCES = ("bindings.cpp", "paged_decode_cpu.cpp", "cpu_gemm.cpp", "cpu_ops.cpp", "cpu_decode_layers.cpp")


def load():
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    try:
        from torch.utils.cpp_extension import load as load_extension

        t0 = time.perf_counter()
        csrc = os.path.join(os.path.dirname(__file__), "csrc")
        _kernel = load_extension(
            "shoal_cpu_kernels",
            [os.path.join(csrc, s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - t0)
    except Exception as e:  # no compiler or ninja, an unusual platform
        logger.warning("CPU kernels unavailable (%s); using the torch path", e)
        _kernel = None
    return _kernel
