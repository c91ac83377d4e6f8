"""vLLM's CustomOp, reduced to what shoal's small ops need: a torch
reference (forward_native), one fused Triton kernel (forward_fused, see
fused_ops) and the compiled CPU kernels (forward_cpu, once the model runner
binds them). Which one forward runs is chosen once, when the layer is
built, never by looking at the environment on a call."""

from __future__ import annotations

import torch
from torch import nn


class CustomOp(nn.Module):
    def __init__(self, fused_ops: bool = False):
        """fused_ops: the Triton kernels off CUDA too (EngineArgs.fused_ops).
        On CUDA they always run: the device is the one the layer is built on
        (the loader builds the model under `with torch.device(...)`)."""
        super().__init__()
        self.cpu_kernels = None  # the compiled CPU kernels, when the model runner binds them
        self.use_fused = fused_ops or torch.empty(0).device.type == "cuda"
        self._forward_method = self.forward_fused if self.use_fused else self.forward_cpu

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_fused(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        """The compiled kernels where bound and the op takes them, else the reference."""
        return self.forward_native(*args, **kwargs)
