"""Random weights made from a model's config alone (vLLM's --load-format
dummy), so a benchmark of an 8B or 70B shape needs no checkpoint.

They come as a checkpoint would: full-shaped tensors under Hugging Face
names, one at a time, through the model's load_weights. Each tensor parallel
rank thus draws the same full tensors (one fixed seed, one fixed order) and
keeps its own slice of one consistent model, and load_weights checks that
every parameter got a tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shoal.workers.model_executor.models.config import ModelConfig

SEED = 1234  # vLLM's dummy loader's
LOW, HIGH = -1e-3, 1e-3  # vLLM's range: small enough that activations stay finite


def dummy_weight_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face checkpoint's tensor names and full shapes, as the
    model class lists them (`checkpoint_shapes`)."""
    from shoal.workers.model_executor.models.registry import get_model_class

    return get_model_class(cfg.architecture).checkpoint_shapes(cfg)


def dummy_weights(cfg: ModelConfig, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Norms are ones (as a fresh model's), everything else uniform in
    [LOW, HIGH]. Drawn on `device`: on a GPU a 70B shape takes seconds, on
    the CPU minutes. Ranks on one device type draw the same numbers."""
    gen = torch.Generator(device).manual_seed(SEED)
    for name, shape in dummy_weight_shapes(cfg):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.empty(shape, device=device).uniform_(LOW, HIGH, generator=gen)
