"""The embedding and the LM head split by vocabulary across the
tensor-parallel group. Each rank holds ceil(vocab / tp_size) rows (the last
rank's tail is zero padding); the LM head's logits are gathered to rank 0.
Like the linear layers, each owns a method object (quantization/) that holds
the rows: unquantized unless a quantization config gives another."""

from __future__ import annotations

import torch
from torch import nn

from shoal.proto.utils import cdiv
from shoal.workers.model_executor.layers.parallel_state import get_tp_group
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedEmbeddingMethod
from shoal.workers.model_executor.layers.weight_utils import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows = cdiv(vocab_size, self.tp.size)  # per rank, padded
        self.start = self.tp.rank * self.rows
        self.end = min(self.start + self.rows, vocab_size)  # real rows end here
        method = None if quant_config is None else quant_config.get_quant_method(self, prefix)
        self.quant_method = UnquantizedEmbeddingMethod() if method is None else method
        self.quant_method.create_weights(
            self,
            hidden_size,
            [self.rows],
            hidden_size,
            vocab_size,
            torch.get_default_dtype(),
            weight_loader=self.weight_loader,
        )

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int | None = None) -> None:
        check_shape("vocabulary weight", tensor.shape, (self.vocab_size, self.hidden_size))
        if hasattr(param, "store_part"):  # a method that keeps its own storage (GGUF blocks), padded the same
            param.store_part(None, tensor[self.start : self.end], self.rows)
            return
        param.data.zero_()
        param.data[: self.end - self.start].copy_(tensor[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.embedding(self, input_ids)
        # Ids outside this rank's rows contribute zeros; the sum over ranks
        # gives every token its one real row.
        outside = (input_ids < self.start) | (input_ids >= self.end)
        h = self.quant_method.embedding(self, (input_ids - self.start).masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """Same split as the embedding, so a tied head shares its weight."""

    cpu_kernels = None  # the compiled CPU kernels, when the model runner uses them

    def forward(self, h: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [tokens, vocab] on rank 0; None on other ranks."""
        parts = self.tp.gather(self.quant_method.apply(self, h).float())
        if parts is None:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)[:, : self.vocab_size]
