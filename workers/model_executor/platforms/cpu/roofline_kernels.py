"""The peak-rate loops of csrc/roofline.cpp (`shoal_roofline`): for float32
FMA, int8 and bfloat16 dot products, each instruction path the CPU may have.

Built alone, apart from shoal_cpu_kernels, so that it builds in a minute
and a change to the serving kernels does not rebuild it (kernel_build.py:
its own cache folder, lock and key). Only the benchmarks use it
(benchmarks/roofline.py). load() returns None where it cannot be built.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
_kernel = None
_tried = False


def load():
    global _kernel, _tried
    if _tried:
        return _kernel
    from shoal.workers.model_executor.platforms.cpu.kernel_build import KernelBuildTimeout, load_extension

    try:
        csrc = os.path.join(os.path.dirname(__file__), "csrc")
        # The project's flags: every path beyond -march=native is under its own target attribute.
        _kernel = load_extension(
            "shoal_roofline",
            [os.path.join(csrc, "roofline.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except KernelBuildTimeout:
        raise  # not remembered: a later call waits again
    except Exception as e:  # no compiler or ninja, an unusual platform
        logger.warning("the roofline kernels are unavailable (%s)", e)
        _kernel = None
    _tried = True
    return _kernel
