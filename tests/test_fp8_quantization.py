"""--quantization fp8: a float checkpoint's linear layers quantized to e4m3
at load, with one scale per tensor, and activations quantized per token at
each call (layers/quantization/fp8.py). On the CPU the fp8 values are
dequantized and multiplied in float32 (triton_quant.fp8_w8a8_mm's
reference), so these tests check the quantization, not a GPU GEMM.

Checked on the tiny random model against --quantization none:
- every linear weight stored as e4m3 (1 byte a weight), its scale one per
  row; embedding and LM head left in float;
- the top-5 log-probabilities after each forced prefix differ from none's
  by at most LOGPROB_MEAN_TOL on average and LOGPROB_WORST_TOL at worst
  (e4m3 has 3 mantissa bits: each weight and activation is off by up to
  2^-4 relative);
- teacher-forced greedy agreement with none on at least half the positions;
- a layer's output within the elementwise bound of e4m3 rounding, with a
  per-tensor or a per-channel scale.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Like the other Triton tests: the process interprets (see test_triton_quant); the CUDA checks
# below rerun this file in a process that compiles (SHOAL_TRITON_COMPILED=1).
if not os.environ.get("SHOAL_TRITON_COMPILED"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.linear import LinearBase
from shoal.workers.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from shoal.workers.model_executor.layers.quantization.triton_quant import FP8_DTYPE
from shoal.workers.model_executor.loader.model_loader import weight_bytes

PROMPTS = ["Hello world", "The quick brown", "def add(a, b):", "Numbers: 0 1 2"]
# No compiled extension: the fp8 path does not use it, and the test stays quick.
ENGINE = dict(num_threads=1, num_kv_blocks=64, cpu_kernels=False)
# e4m3 rounds each weight and activation by up to 2^-4 (2.6% RMS, measured per layer: 3.5% on a
# layer's output), and a random tiny model's logits are nearly flat (top-2 gaps of 0.02-1.7 nats):
# measured on tiny_model, the top-5 log-probabilities differ by 0.32 nats on average, 1.9 at worst,
# and the greedy token agrees on 62% of forced positions. The bounds leave room for that, no more.
LOGPROB_MEAN_TOL = 0.75  # nats, mean over the tokens in both top 5s
LOGPROB_WORST_TOL = 3.0
MIN_AGREEMENT = 0.5


def _model(llm: LLM):
    return llm.engine.model_executor.driver_worker.runner.model


def _forced_logprobs(llm: LLM, asks: list[list[int]]) -> list[dict[int, float]]:
    outs = llm.generate(asks, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    return [o.logprobs[0].top_logprobs for o in outs]


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model, **ENGINE) as none:
        ids = [none.tokenizer.encode(p) for p in PROMPTS]
        cont = [o.token_ids for o in none.generate(ids, sp)]
        asks = [p + c[:i] for p, c in zip(ids, cont) for i in range(len(c))]
        want = _forced_logprobs(none, asks)
        none_bytes = weight_bytes(_model(none))
    with LLM(tiny_model, quantization="fp8", **ENGINE) as fp8:
        model = _model(fp8)
        layers = [m for m in model.modules() if isinstance(m, LinearBase)]
        stored = {
            "methods": {type(m.quant_method) for m in layers},
            "dtypes": {m.weight.dtype for m in layers},
            "scales": [(m.weight_scale.dtype, tuple(m.weight_scale.shape), m.weight.shape[0]) for m in layers],
            "linear_numel": sum(m.weight.numel() for m in layers),
            "float_dtypes": {model.embed_tokens.weight.dtype, model.lm_head.weight.dtype},
            "bytes": weight_bytes(model),
        }
        got = _forced_logprobs(fp8, asks)
    return dict(want=want, got=got, stored=stored, none_bytes=none_bytes)


def test_every_linear_weight_is_stored_in_fp8_at_one_byte_each(runs):
    s = runs["stored"]
    assert s["methods"] == {Fp8LinearMethod} and s["dtypes"] == {FP8_DTYPE}
    assert all(dt == torch.float32 and shape == (rows,) for dt, shape, rows in s["scales"])
    assert s["float_dtypes"] == {torch.float32}  # embedding and LM head unquantized, as vLLM
    # float32 linear weights (4 bytes) became 1 byte each, plus a 4-byte scale a row
    saved = runs["none_bytes"] - s["bytes"]
    rows = sum(r for _, _, r in s["scales"])
    assert saved == 3 * s["linear_numel"] - 4 * rows


def test_logprobs_follow_the_float_model_within_the_stated_tolerance(runs):
    worst, agree, diffs = 0.0, 0, []
    for want, got in zip(runs["want"], runs["got"]):
        top = max(want, key=want.get)
        agree += max(got, key=got.get) == top
        common = want.keys() & got.keys()
        diffs += [abs(got[t] - want[t]) for t in common]
        worst = max([worst, *diffs])
    share = agree / len(runs["want"])
    mean = sum(diffs) / len(diffs)
    print(f"\nfp8 vs none: logprob difference mean {mean:.3f}, worst {worst:.3f} nats; agreement {share:.1%}")
    assert mean <= LOGPROB_MEAN_TOL and worst <= LOGPROB_WORST_TOL
    assert share >= MIN_AGREEMENT


def test_the_config_quantizes_linear_layers_only():
    from shoal.workers.model_executor.layers.quantization import get_quantization_config
    from shoal.workers.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    cfg = get_quantization_config("fp8").from_config({})
    assert isinstance(cfg, Fp8Config) and cfg.get_name() == "fp8"
    assert isinstance(cfg.get_quant_method(LinearBase(), "model.layers.0.mlp.down_proj"), Fp8LinearMethod)
    assert cfg.get_quant_method(VocabParallelEmbedding.__new__(VocabParallelEmbedding), "lm_head") is None


def test_apply_takes_a_per_channel_or_per_tensor_scale():
    # The compressed-tensors config loads either into the same parameters.
    from shoal.workers.model_executor.layers.quantization.triton_quant import quantize_weight_fp8

    torch.manual_seed(0)
    layer, x, w = LinearBase(), torch.randn(3, 64), torch.randn(32, 64)
    ref = x.double() @ w.double().t()
    bound = 0.13 * (x.double().abs() @ w.double().abs().t()) + 1e-6  # 2 * 2^-4 + 2^-8, see test_triton_quant
    for per_channel in (False, True):
        q, s = quantize_weight_fp8(w, per_channel)
        layer.weight, layer.weight_scale = torch.nn.Parameter(q, False), torch.nn.Parameter(s, False)
        y = Fp8LinearMethod().apply(layer, x)
        assert y.shape == (3, 32) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= bound).all()


# ---- on CUDA only (the later GPU session): the compiled kernels and torch._scaled_mm ----


def cuda(test):
    """CUDA only: the GPU check (scripts/gpu_check.py) runs these, as -m gpu."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _compiled():
    from shoal.workers.model_executor.layers.quantization import triton_quant as tq

    if tq.triton is None or tq.interpreted():
        pytest.skip("Triton is absent or interpreted in this process: test_cuda_checks_compiled runs these")
    return tq


@cuda
def test_cuda_checks_compiled():
    """The cuda_ tests of this file in a process where Triton compiles."""
    from shoal.workers.model_executor.layers.quantization import triton_quant as tq

    if not tq.interpreted():
        pytest.skip("this process compiles: the cuda_ tests ran here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"SHOAL_TRITON_COMPILED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-k", "test_cuda_ and not checks_compiled", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@cuda
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_cuda_fp8_matmul_equals_the_reference_of_the_same_fp8_values(m, per_channel):
    tq = _compiled()
    torch.manual_seed(m)
    dev = torch.device("cuda")
    x = torch.randn(m, 512, device=dev, dtype=torch.bfloat16)
    q, s = tq.quantize_weight_fp8(torch.randn(256, 512, device=dev), per_channel)
    b = torch.randn(256, device=dev, dtype=torch.bfloat16)
    xq, xs = tq.per_token_quant_fp8(x)
    xq_ref, xs_ref = tq.per_token_quant_fp8_ref(x)
    torch.testing.assert_close(xs, xs_ref, rtol=1e-6, atol=0)
    assert (xq.float() != xq_ref.float()).float().mean() < 0.01  # GPU division rounds a hair differently
    if torch.cuda.get_device_capability() >= (9, 0):  # Hopper: per-token x per-channel scales inside the GEMM
        assert tq.scaled_mm_kind(x, q, torch.bfloat16) == "rowwise"
    y = tq.fp8_w8a8_mm(x, q, s, b)
    want = tq.fp8_w8a8_mm_ref(xq, xs, q, s, b, torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 256)
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


@cuda
@pytest.mark.parametrize("m", [1, 7, 300])
def test_cuda_int8_and_w4a16_kernels_equal_their_references(m):
    tq = _compiled()
    torch.manual_seed(m)
    dev = torch.device("cuda")
    x = torch.randn(m, 384, device=dev, dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (200, 384), dtype=torch.int8, device=dev)
    ws = torch.rand(200, device=dev) / 100
    ref = tq.int8_w8a8_mm_ref(x, w, ws, None, torch.float64)
    torch.testing.assert_close(tq.int8_w8a8_mm(x, w, ws).double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    packed = tq.pack_int4(torch.randint(-8, 8, (200, 384), dtype=torch.int8, device=dev))
    scale = (torch.rand(200, 3, device=dev) / 10).to(torch.bfloat16)
    wd = tq.dequantize_int4(packed, scale, 384).to(torch.bfloat16).double()
    ref = x.double() @ wd.t()
    torch.testing.assert_close(
        tq.w4a16_mm(x, packed, scale).double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()
    )


@cuda
def test_cuda_engine_serves_fp8_close_to_bf16(tiny_model):
    # bfloat16 on the card, CUDA graphs on: the fp8 layers run torch._scaled_mm inside the graphs.
    gpu = dict(num_kv_blocks=64, device="cuda")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model, **gpu) as none:
        ids = [none.tokenizer.encode(p) for p in PROMPTS]
        cont = [o.token_ids for o in none.generate(ids, sp)]
        asks = [p + c[:i] for p, c in zip(ids, cont) for i in range(len(c))]
        want = _forced_logprobs(none, asks)
    with LLM(tiny_model, quantization="fp8", **gpu) as fp8:
        assert _model(fp8).layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
        got = _forced_logprobs(fp8, asks)
    diffs = [abs(g[t] - w[t]) for w, g in zip(want, got) for t in w.keys() & g.keys()]
    agree = sum(max(g, key=g.get) == max(w, key=w.get) for w, g in zip(want, got)) / len(want)
    print(f"\ncuda fp8 vs bf16: logprob difference mean {sum(diffs) / len(diffs):.3f}, agreement {agree:.1%}")
    assert sum(diffs) / len(diffs) <= LOGPROB_MEAN_TOL and max(diffs) <= LOGPROB_WORST_TOL
    assert agree >= MIN_AGREEMENT
