"""The compiled CPU decode-attention kernel (csrc/paged_decode_cpu.cpp).

Built once with torch's extension loader and cached under
~/.cache/torch_extensions (`make install` builds it ahead). load() returns
None where it cannot be built (no compiler) or SHOAL_CPU_KERNEL=0 is set:
the pure-torch path then runs, and it stays the reference either way.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)
_kernel = None
_tried = False


def load():
    global _kernel, _tried
    if _tried:
        return _kernel
    _tried = True
    if os.environ.get("SHOAL_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        t0 = time.perf_counter()
        src = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode_cpu.cpp")
        _kernel = load_extension("shoal_paged_decode_cpu", [src], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                 extra_ldflags=["-fopenmp"])  # fmt: skip
        logger.info("CPU decode kernel ready in %.1f s", time.perf_counter() - t0)
    except Exception as e:  # no compiler or ninja, an unusual platform
        logger.warning("CPU decode kernel unavailable (%s); using the torch path", e)
        _kernel = None
    return _kernel
