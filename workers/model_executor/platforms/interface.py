"""The seams between the model runner and a platform's own fast paths."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class DecodeStep(Protocol):
    """A model's whole forward for a step whose rows are all decodes, in one
    call of a platform's compiled layers (cpu/decode_step.py), built over the
    model's decode plan (models/decode_plan.py) and bound to its weights and
    KV cache. The model runner takes it for every decode-only step, as it
    replays a CUDA graph for those on CUDA."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """Logits at `logits_indices`, as the model's forward gives them; meta:
        the attention backend's metadata for the step."""
        ...

    def unbind(self) -> None:
        """Drops its hold on the KV cache (the runner frees or replaces it)."""
        ...
