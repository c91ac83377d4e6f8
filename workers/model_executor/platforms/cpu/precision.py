"""Which dtype the CPU multiplies in.

bfloat16 where the CPU has bfloat16 dot products: AVX512-BF16's vdpbf16ps
(Zen 4, Cooper Lake and later Xeons) or AMX tiles (Sapphire Rapids and
later), twice float32's FMA rate. torch's bfloat16 matmuls (F.linear,
torch.matmul, SDPA) reach them through oneDNN with float32 sums, so a
bfloat16 model's linear layers, attention and LM head multiply in
bfloat16 while its norms, logits and sampling stay float32 (as
transformers and vLLM run bfloat16).

Elsewhere torch emulates bfloat16 and runs 7-9x slower than float32 at
64-256 rows (a 2-core AVX2 Zen 3, single-threaded): there the engine
computes in float32, and bfloat16 weights stay stored in bfloat16,
widened as they are read (matmul.py).

SHOAL_CPU_BF16 overrides the detection: 1 computes in bfloat16 on any CPU
(correct but slow without the instructions: for tests), 0 never does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

ENV = "SHOAL_CPU_BF16"


def native_bf16(caps: Mapping | None = None) -> str | None:
    """The bfloat16 instructions this CPU has ("AMX", "AVX512-BF16"), None
    without; caps: torch.cpu.get_capabilities()'s mapping (tests fake it)."""
    if caps is None:
        caps = torch.cpu.get_capabilities()
    if caps.get("amx_bf16"):
        return "AMX"
    if caps.get("avx512_bf16"):
        return "AVX512-BF16"
    return None


def cpu_bf16_compute(caps: Mapping | None = None) -> tuple[bool, str]:
    """(whether a CPU engine computes in bfloat16 where asked, why): the
    CPU's own instructions through oneDNN, unless SHOAL_CPU_BF16 says otherwise."""
    env = os.environ.get(ENV, "auto")
    if env == "1":
        return True, f"{ENV}=1"
    if env == "0":
        return False, f"{ENV}=0"
    if env != "auto":
        raise ValueError(f"{ENV} must be 0, 1 or auto; got {env!r}")
    isa = native_bf16(caps)
    if isa is None:
        return False, "this CPU has neither AVX512-BF16 nor AMX"
    if not torch.backends.mkldnn.is_available():
        return False, f"this CPU has {isa} but torch was built without oneDNN"
    return True, f"{isa} through oneDNN"


def compute_dtype(model: torch.nn.Module) -> str:
    """What the model's matmuls multiply in: int8 where its linear layers
    take integer dot products (GGUF blocks, int8 and W8A8-int8 weights),
    fp8 under fp8 weights, else the model's dtype (bfloat16 weights under a
    float32 model are widened: float32)."""
    from shoal.workers.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod
    from shoal.workers.model_executor.layers.quantization.int8 import Int8LinearMethod

    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, (GGUFLinearMethod, Int8LinearMethod)):
            return "int8"
        if isinstance(method, Fp8LinearMethod):
            return "fp8"
    return str(model.dtype).removeprefix("torch.")
