"""Copying checkpoint tensors into parameters, with a clear error on a
shape mismatch. Parallel layers give their parameters loaders of their own
that cut this rank's slice (linear.py, vocab_parallel_embedding.py)."""

from __future__ import annotations

import torch
from torch import nn


def check_shape(name: str, got: torch.Size, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: checkpoint shape {tuple(got)} != expected {tuple(want)}")


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
    check_shape("parameter", tensor.shape, param.shape)
    param.data.copy_(tensor)
