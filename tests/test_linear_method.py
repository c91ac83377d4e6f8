"""Linear layers own a method object (layers/quantization/): the unquantized
method is today's F.linear on this rank's slice, a QuantizationConfig plugs
its own method into every layer of a model without touching the model file,
and the registry refuses names it does not know."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.workers.model_executor.layers import parallel_state
from shoal.workers.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from shoal.workers.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from shoal.workers.model_executor.layers.quantization.base_config import QuantizationConfig
from shoal.workers.model_executor.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)
from shoal.workers.model_executor.loader.dummy_weights import dummy_weights
from shoal.workers.model_executor.loader.model_loader import build_model
from shoal.workers.model_executor.models.config import ModelConfig
from shoal.workers.model_executor.platforms.cpu.decode_step import CPUDecodeStep

CPU = torch.device("cpu")
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 32, 8, 4, 2


def as_rank(monkeypatch, rank: int, size: int) -> None:
    """Layers read the group when built; loading and a column layer's matmul run no collective."""
    monkeypatch.setattr(parallel_state, "_group", parallel_state.TPGroup(rank, size))


def load(layer, tensors: dict[int | None, torch.Tensor], bias: dict[int | None, torch.Tensor]) -> None:
    for shard, t in tensors.items():
        layer.weight.weight_loader(layer.weight, t, shard)
    for shard, t in bias.items():
        layer.bias.weight_loader(layer.bias, t, shard)


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 > 2 KV heads: each rank holds one replicated KV head
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_and_merged_column_shards_compute_f_linear_on_their_rows(monkeypatch, tp, bias):
    torch.manual_seed(0)
    q, k, v = (torch.randn(n * HEAD_DIM, HIDDEN) for n in (HEADS, KV_HEADS, KV_HEADS))
    qb, kb, vb = (torch.randn(t.shape[0]) for t in (q, k, v))
    gate, up = torch.randn(64, HIDDEN), torch.randn(64, HIDDEN)
    gb, ub = torch.randn(64), torch.randn(64)
    x = torch.randn(5, HIDDEN)
    for rank in range(tp):
        as_rank(monkeypatch, rank, tp)
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias)
        load(qkv, {0: q, 1: k, 2: v}, {0: qb, 1: kb, 2: vb} if bias else {})
        qr = slice(rank * HEADS // tp * HEAD_DIM, (rank + 1) * HEADS // tp * HEAD_DIM)
        kv_head = rank * KV_HEADS // tp  # a split head, or the one this rank shares with its neighbours
        kvr = slice(kv_head * HEAD_DIM, (kv_head + max(1, KV_HEADS // tp)) * HEAD_DIM)
        w = torch.cat([q[qr], k[kvr], v[kvr]])
        b = torch.cat([qb[qr], kb[kvr], vb[kvr]]) if bias else None
        mlp = ColumnParallelLinear.even(HIDDEN, [64, 64], bias)
        load(mlp, {0: gate, 1: up}, {0: gb, 1: ub} if bias else {})
        r = slice(rank * 64 // tp, (rank + 1) * 64 // tp)
        mw = torch.cat([gate[r], up[r]])
        mb = torch.cat([gb[r], ub[r]]) if bias else None
        for layer, want_w, want_b in ((qkv, w, b), (mlp, mw, mb)):
            assert isinstance(layer.quant_method, UnquantizedLinearMethod)
            torch.testing.assert_close(layer.weight, want_w, rtol=0, atol=0)
            torch.testing.assert_close(layer(x), F.linear(x, want_w, want_b), rtol=0, atol=0)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_row_shards_sum_to_f_linear(monkeypatch, tp, bias):
    torch.manual_seed(0)
    w, b, x = torch.randn(HIDDEN, 64), torch.randn(HIDDEN), torch.randn(5, 64)
    partial = []
    for rank in range(tp):
        as_rank(monkeypatch, rank, tp)
        row = RowParallelLinear(64, HIDDEN, bias)
        load(row, {None: w}, {None: b} if bias else {})
        cols = slice(rank * 64 // tp, (rank + 1) * 64 // tp)
        torch.testing.assert_close(row.weight, w[:, cols], rtol=0, atol=0)
        if tp == 1:  # forward itself; under a fake group the all-reduce has no peers
            torch.testing.assert_close(row(x), F.linear(x, w, b if bias else None), rtol=0, atol=0)
        partial.append(row.quant_method.apply(row, x[:, cols]))  # what each rank all-reduces
    got = sum(partial) + (b if bias else 0)
    torch.testing.assert_close(got, F.linear(x, w, b if bias else None))


class FakeKernels:
    """Stands in for the compiled CPU module: records the few-row matmuls it is given."""

    def __init__(self):
        self.calls = []

    def small_m_linear(self, x, weight, bias):
        self.calls.append(tuple(x.shape))
        return F.linear(x, weight, bias)


def test_the_method_takes_the_layers_cpu_kernels_for_few_rows():
    layer = ColumnParallelLinear.even(HIDDEN, [64], True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.cpu_kernels = kernels = FakeKernels()  # set as the model runner sets it
    layer(torch.randn(3, HIDDEN))
    layer(torch.randn(300, HIDDEN))  # past MAX_KERNEL_ROWS: the BLAS
    assert kernels.calls == [(3, HIDDEN)]


class Doubled(UnquantizedLinearMethod):
    def __init__(self, processed: list):
        self.processed = processed

    def apply(self, layer, x, bias=None):
        return 2 * super().apply(layer, x, bias)

    def process_weights_after_loading(self, layer):
        self.processed.append(layer)


class DoubleEveryLinear(QuantizationConfig):
    """A stand-in for a quantized format: every linear layer's output doubled."""

    def __init__(self):
        self.asked: dict[str, type] = {}
        self.processed: list = []

    def get_name(self) -> str:
        return "double"

    @classmethod
    def from_config(cls, config: dict) -> DoubleEveryLinear:
        return cls()

    def get_quant_method(self, layer, prefix):
        self.asked[prefix] = type(layer)
        return Doubled(self.processed) if isinstance(layer, LinearBase) else None


def tiny_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def test_a_quantization_config_plugs_a_method_into_every_layer_of_the_model():
    cfg = tiny_config()
    quant = DoubleEveryLinear()
    model = build_model(cfg, dummy_weights(cfg, CPU), 64, CPU, torch.float32, quant_config=quant)
    plain = build_model(cfg, dummy_weights(cfg, CPU), 64, CPU, torch.float32)
    layer_names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "self_attn.o_proj")]
    layer_names += [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.gate_up_proj", "mlp.down_proj")]
    assert set(quant.asked) == {"model.embed_tokens", "lm_head", *layer_names}  # vLLM's prefixes
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 8 and all(isinstance(m.quant_method, Doubled) for m in linears)
    assert sorted(map(id, quant.processed)) == sorted(map(id, linears))  # once each, after loading
    assert isinstance(model.embed_tokens.quant_method, UnquantizedEmbeddingMethod)  # None: unquantized
    # The model's own MLP, with no change to it, now runs the doubled matmuls.
    x = torch.randn(3, HIDDEN)
    mlp, ref = model.layers[0].mlp, plain.layers[0].mlp
    gate, up = (2 * F.linear(x, ref.gate_up_proj.weight)).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), 2 * F.linear(F.silu(gate) * up, ref.down_proj.weight))
    torch.testing.assert_close(model.lm_head(x), plain.lm_head(x), rtol=0, atol=0)
    # The one-call C++ decode step reads each weight as it is: it stands aside for any other method.
    kernels = object()  # stands for the loaded extension; create() only checks that there is one
    assert CPUDecodeStep.create(plain, kernels) is not None and CPUDecodeStep.create(model, kernels) is None


def test_the_registry_knows_its_methods_and_refuses_other_names():
    assert QUANTIZATION_METHODS == ("none", "gguf", "int8", "fp8", "compressed-tensors")
    assert get_quantization_config(None) is None and get_quantization_config("none") is None
    for name in ("gguf", "int8", "fp8"):  # each module imports, and its config answers to its name
        assert get_quantization_config(name).from_config({}).get_name() == name
    assert get_quantization_config("compressed-tensors").__name__ == "CompressedTensorsConfig"
    with pytest.raises(ValueError, match="unknown quantization method 'int4'; shoal knows none, gguf, int8, fp8"):
        get_quantization_config("int4")
