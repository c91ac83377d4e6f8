"""LoRA around a linear layer: the base layer's matmul once for the whole
step, then each segment's adapter added from fixed slots (ops.add_lora).

The slots are this rank's share of up to max_loras adapters, padded to
max_lora_rank: per fused part (q, k, v; gate, up), A [slots, in, R] and
B [slots, R, out]. Sharded as the base layer is: a column-parallel layer
keeps A whole and this rank's rows of each part's B; a row-parallel layer
keeps its columns of A and B whole, and adds its partial update before the
all-reduce (the sum over ranks of (x_r A_r) B is x A B). Filling a slot
is a copy; the step's rows come from lora_context(): on CUDA the Triton
kernels (triton_ops.py) read each token's slot from a device tensor, so a
decode step's launches are fixed and a CUDA graph captures them once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from shoal.workers.lora.ops import Segment, add_lora, lora_segments
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear


@dataclass
class _Step:
    """The step's rows under each adapter slot: `row_slots`, each token's slot
    (NO_LORA: the base) on the step's device, staged with its inputs. CUDA's
    Triton kernels read it as it is (a CUDA graph's static input, so the
    launches never change); the CPU's paths take the runs of rows of one slot
    made from it, once a step."""

    row_slots: torch.Tensor
    segments: list[Segment] | None = None
    table: torch.Tensor | None = None

    def cpu_segments(self) -> list[Segment]:
        if self.segments is None:
            self.segments = lora_segments(self.row_slots)
        return self.segments

    def segment_table(self) -> torch.Tensor:
        """The segments as int64 [S, 3] (start, length, slot): the CPU kernel's form."""
        if self.table is None:
            segs = self.cpu_segments()
            self.table = torch.tensor([(s.start, s.length, s.slot) for s in segs], dtype=torch.long).reshape(-1, 3)
        return self.table

    @property
    def active(self) -> bool:
        """Whether the layers add anything (a CUDA step always launches: its graph may be captured)."""
        return self.row_slots.is_cuda or bool(self.cpu_segments())


_step: _Step | None = None  # this step's (lora_context)


@contextlib.contextmanager
def lora_context(row_slots: torch.Tensor | None):
    """The step's slot of each token (None: no LoRA), for every LoRA layer's forward."""
    global _step
    previous = _step
    _step = None if row_slots is None else _Step(row_slots)
    try:
        yield
    finally:
        _step = previous


@dataclass
class _Part:
    module: str  # the checkpoint's name of this part (q_proj, ...)
    out_offset: int  # its first column in the layer's (local) output
    rows: tuple[int, int]  # (first, count) of the part's output rows kept on this rank
    cols: tuple[int, int]  # (first, count) of the input features kept on this rank
    lora_a: torch.Tensor  # [slots, in_local, R]
    lora_b: torch.Tensor  # [slots, R, out_local]


class LoRALinear(nn.Module):
    """A column- or row-parallel linear layer with LoRA slots beside it."""

    def __init__(
        self,
        base: nn.Module,
        modules: tuple[str, ...],
        max_loras: int,
        max_rank: int,
        scalings: torch.Tensor,
        dtype: torch.dtype,
    ):
        """modules: the checkpoint names of the base layer's parts, in order;
        scalings: [slots] float32, shared by every layer (the manager's);
        dtype: the model's activations' (the slots are kept in it)."""
        super().__init__()
        self.base = base
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.scalings = scalings
        device = scalings.device
        self.parts: list[_Part] = []
        if self.row_parallel:
            local = base.input_full // base.tp.size
            (module,) = modules
            a = torch.zeros(max_loras, local, max_rank, dtype=dtype, device=device)
            b = torch.zeros(max_loras, max_rank, base.output_size, dtype=dtype, device=device)
            self.parts.append(_Part(module, 0, (0, base.output_size), (base.input_start, local), a, b))
        else:
            assert isinstance(base, ColumnParallelLinear) and len(modules) == len(base.shards)
            offset = 0
            for module, (_, local, start) in zip(modules, base.shards):
                a = torch.zeros(max_loras, base.input_size, max_rank, dtype=dtype, device=device)
                b = torch.zeros(max_loras, max_rank, local, dtype=dtype, device=device)
                self.parts.append(_Part(module, offset, (start, local), (0, base.input_size), a, b))
                offset += local

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Slot `slot` from an adapter's (A [r, in], B [out, r]) of this
        layer's modules (a module the adapter leaves out stays zero); None empties it."""
        for p in self.parts:
            p.lora_a[slot].zero_()
            p.lora_b[slot].zero_()
            if weights is None or p.module not in weights:
                continue
            a, b = weights[p.module]
            r = a.shape[0]
            p.lora_a[slot, :, :r].copy_(a.narrow(1, *p.cols).t())
            p.lora_b[slot, :r].copy_(b.narrow(0, *p.rows).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, step = self.base, _step
        active = step is not None and step.active
        if not self.row_parallel:
            y = base(x)
            if active:
                self._add(y, x, step)
            return y
        if base.tp.size == 1:
            y = base.quant_method.apply(base, x, base.bias)
            if active:
                self._add(y, x, step)
            return y
        y = base.quant_method.apply(base, x)
        if active:
            self._add(y, x, step)  # this rank's partial update, summed by the reduction
        y = base.tp.all_reduce(y)
        return y if base.bias is None else y + base.bias

    def _add(self, y: torch.Tensor, x: torch.Tensor, step: _Step) -> None:
        shape = y.shape
        y2, x2 = y.view(-1, shape[-1]), x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            # Imported here, not with the module: importing triton decides, once, whether its kernels are
            # compiled or interpreted (TRITON_INTERPRET), which a CPU process must not settle early.
            from shoal.workers.lora import triton_ops

            if triton_ops.available_for(x2):  # (no triton installed: the torch path, eager only)
                for p in self.parts:
                    triton_ops.add_lora_triton(y2, x2, p.lora_a, p.lora_b, self.scalings, step.row_slots, p.out_offset)
                return
        segments = step.cpu_segments()
        kernels = getattr(self.base, "cpu_kernels", None)  # bound when the CPU kernels are on (platforms/cpu/bind.py)
        if kernels is not None and x2.dtype == y2.dtype == torch.float32 and self.parts[0].lora_a.shape[2] <= 256:
            table = step.segment_table()
            x2 = x2.contiguous()
            for p in self.parts:  # csrc/lora_cpu.cpp: every segment of the part in one call
                kernels.lora_add(y2, x2, p.lora_a, p.lora_b, self.scalings, table, p.out_offset)
            return
        for p in self.parts:
            add_lora(y2, x2, p.lora_a, p.lora_b, self.scalings, segments, p.out_offset)
