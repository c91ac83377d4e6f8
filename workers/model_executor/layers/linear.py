"""Linear layers split across the tensor-parallel group (Megatron's layout).

Column-parallel layers split the output features: each rank computes its
slice and nothing is exchanged. Row-parallel layers split the input
features: each rank's partial sum is all-reduced. A column layer followed by
a row layer (q/k/v -> o, gate/up -> down) costs one all-reduce.

Each layer owns a method object (quantization/): the method registers the
weight and computes x W^T; the layer keeps the split. Unquantized (the
default, no config) is today's weight and platforms/cpu/matmul.py's matmul. Each
parameter carries a `weight_loader(param, tensor, shard_id)` that cuts this
rank's part out of a full checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.model_executor.layers.parallel_state import get_tp_group, num_local_kv_heads
from shoal.workers.model_executor.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from shoal.workers.model_executor.layers.weight_utils import check_shape, default_weight_loader


class LinearBase(nn.Module):
    """What every linear layer shares: its method, asked of the config once
    (None: unquantized), and the compiled CPU kernels the method reads (bound
    by platforms/cpu/bind.py, None until then)."""

    def __init__(self, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod() if method is None else method
        self.cpu_kernels = None


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (output features) split across ranks.

    The layer may fuse several checkpoint tensors (gate and up, say): each
    is one shard, given as (full rows, local rows, first row taken here).
    """

    def __init__(
        self,
        input_size: int,
        shards: list[tuple[int, int, int]],
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(quant_config, prefix)
        self.input_size, self.shards = input_size, shards
        local = [n for _, n, _ in shards]
        self.output_size = sum(local)  # on this rank
        full_size = sum(n for n, _, _ in shards)
        self.quant_method.create_weights(
            self, input_size, local, input_size, full_size, torch.get_default_dtype(), weight_loader=self.weight_loader
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    @classmethod
    def even(
        cls,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> ColumnParallelLinear:
        """Each fused part split evenly: rank r takes the r-th slice of each."""
        tp = get_tp_group()
        shards = [(n, n // tp.size, tp.rank * (n // tp.size)) for n in output_sizes]
        return cls(input_size, shards, bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        shard_id = shard_id or 0
        full, local, start = self.shards[shard_id]
        check_shape(f"shard {shard_id}", tensor.shape[:1], (full,))
        part = tensor.narrow(0, start, local)
        if hasattr(param, "store_part"):  # a method that keeps its own storage (GGUF blocks)
            param.store_part(shard_id, part)
            return
        offset = sum(n for _, n, _ in self.shards[:shard_id])
        param.data.narrow(0, offset, local).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v fused, split by attention head. With more ranks than KV
    heads, each rank holds one KV head (shared by tp_size / num_kv_heads ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        tp = get_tp_group()
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = num_local_kv_heads(num_kv_heads, tp.size)
        if tp.size <= num_kv_heads:
            kv_first = tp.rank * self.num_kv_heads
        else:
            kv_first = tp.rank // (tp.size // num_kv_heads)
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        q_local, kv_local = self.num_heads * head_dim, self.num_kv_heads * head_dim
        kv = (kv_full, kv_local, kv_first * head_dim)
        super().__init__(hidden_size, [(q_full, q_local, tp.rank * q_local), kv, kv], bias, quant_config, prefix)


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_r W_r^T) + b: W's columns (input features) are split;
    x arrives already split the same way (the output of a column layer)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(quant_config, prefix)
        self.tp = get_tp_group()
        self.input_full, self.output_size = input_size, output_size
        local = input_size // self.tp.size
        self.input_start = self.tp.rank * local
        self.quant_method.create_weights(
            self,
            local,
            [output_size],
            input_size,
            output_size,
            torch.get_default_dtype(),
            weight_loader=self.weight_loader,
        )
        self.bias = None
        if bias:  # added once, after the reduction
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        check_shape("row-parallel weight", tensor.shape, (self.output_size, self.input_full))
        part = tensor.narrow(1, self.input_start, self.input_full // self.tp.size)
        if hasattr(param, "store_part"):
            param.store_part(shard_id, part)
            return
        param.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = self.tp.all_reduce(self.quant_method.apply(self, x))
        return y if self.bias is None else y + self.bias
