"""The fused Triton ops (RMSNorm with and without the residual add,
SiLU-and-multiply, rotary), run by Triton's interpreter on the CPU, against
the layers' torch path; and the engine with them switched on."""

from __future__ import annotations

import os
import subprocess
import sys

# Triton picks interpreted or compiled when a kernel is decorated, so this
# must come before fused_ops is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the fused-op tests need the triton package")

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers import fused_ops
from shoal.workers.model_executor.layers.activation import SiluAndMul
from shoal.workers.model_executor.layers.norm import RMSNorm
from shoal.workers.model_executor.layers.rotary import RotaryEmbedding

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOLERANCE)


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """Records which fused ops ran, so a comparison cannot pass by running
    the torch path twice (the layers below are built with fused_ops=True)."""
    calls: list[str] = []
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
        op = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, _op=op, _name=name: calls.append(_name) or _op(*a))
    return calls


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, fused_ops=True)
    norm.weight.data = torch.randn(hidden) * 0.5 + 1.0
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_rms_norm(fused_calls, hidden, dtype):
    torch.manual_seed(hidden)
    norm, x = _norm(hidden, dtype), torch.randn(5, hidden).to(dtype) * 3
    expected = norm.forward_native(x)
    out = norm(x)
    assert fused_calls == ["rms_norm"]
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_fused_add_rms_norm_updates_the_residual_in_place(fused_calls, hidden, dtype):
    torch.manual_seed(hidden)
    norm, x = _norm(hidden, dtype), torch.randn(3, 2, hidden).to(dtype)
    residual = torch.randn(3, 2, hidden).to(dtype)
    expected, expected_residual = norm.forward_native(x, residual)
    before = residual.clone()
    out, new_residual = norm(x, residual)
    assert fused_calls == ["fused_add_rms_norm"]
    assert new_residual is residual
    assert not torch.equal(residual, before)
    # float32: the same add, exactly; the interpreter rounds to bfloat16 by
    # truncation, where CUDA and torch round to nearest
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(residual, expected_residual, **exact)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 96, 576, 1100])  # 1100: more than one column tile
def test_silu_and_mul(fused_calls, width, dtype):
    torch.manual_seed(width)
    x = (torch.randn(4, 2 * width) * 3).to(dtype)
    expected = SiluAndMul()(x)
    out = SiluAndMul(fused_ops=True)(x)
    assert fused_calls == ["silu_and_mul"]
    assert out.shape == (4, width)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(16, 4, 2), (64, 6, 2), (64, 4, 4), (16, 3, 1)])
def test_rotary(fused_calls, head_dim, q_heads, kv_heads, dtype):
    torch.manual_seed(head_dim + q_heads)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, scaling, fused_ops=True).to(
        dtype
    )  # the loader casts the tables too
    tokens, q_size, kv_size = 6, q_heads * head_dim, kv_heads * head_dim
    # views into one fused qkv output, as LlamaAttention passes them
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 17, 63, 200, 255])
    expected_q, expected_k = rotary.forward_native(positions, q, k)
    before = qkv.clone()
    out_q, out_k = rotary(positions, q, k)
    assert fused_calls == ["rotary_embedding"]
    assert torch.equal(qkv, before)  # new tensors, as the torch path returns
    torch.testing.assert_close(out_q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(out_k, expected_k, **TOLERANCE[dtype])


def test_the_engine_with_fused_ops_gives_the_same_tokens(fused_calls, tiny_model):
    prompts = [[5, 17, 99, 3, 250, 41, 7], [300, 12], [8, 8, 9, 100, 101, 102, 103, 104, 105, 106, 107]]
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = [o.token_ids for o in LLM(tiny_model, dtype="float32", num_kv_blocks=64).generate(prompts, params)]
    assert fused_calls == []  # fused_ops off: the CPU's own path
    fused = LLM(tiny_model, dtype="float32", num_kv_blocks=64, fused_ops=True).generate(prompts, params)
    assert set(fused_calls) == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"}
    assert [o.token_ids for o in fused] == expected


def test_cpu_tensors_without_the_interpreter_are_a_clear_error():
    code = (
        "import torch; from shoal.workers.model_executor.layers.norm import RMSNorm; "
        "RMSNorm(8, 1e-6, fused_ops=True)(torch.ones(2, 8))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "the fused Triton ops need CUDA" in run.stderr
