"""--quantization int8: a float checkpoint's linear layers quantized at load
to INT8 W8A8 (layers/quantization/int8.py), on the tiny random Llama.

- Each linear layer holds int8 [N, K] and float32 scales [N]: about a
  quarter of float32's bytes; the embedding and the LM head stay float.
- Given the same prefixes (36 of them), the log-probability int8 gives
  --quantization none's greedy token is within LOGPROB_TOL of none's at
  worst and MEDIAN_TOL at the median (8-bit weights per channel and 8-bit
  activations per token on a 2-layer model with spiky random weights
  (initializer_range 0.3): measured 0.44 at worst, 0.073 median, 0.21 at the
  90th percentile), and its greedy token agrees with none's on most
  positions (measured 86%).
- The torch path (no compiled kernels) and the kernels give the same tokens
  and log-probabilities to float rounding (the same integers, scaled).
- Greedy tokens equal transformers' at the same precision: its model with
  each decoder linear layer replaced by a W8A8 written in this file (not
  shoal's), compared as the bfloat16 path is, near-ties reported.
"""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch

from shoal.workers import LLM, SamplingParams
from shoal.workers.model_executor.layers.linear import LinearBase
from shoal.workers.model_executor.layers.quantization.int8 import Int8Config, Int8LinearMethod
from shoal.workers.model_executor.loader.model_loader import weight_bytes

ENGINE = dict(num_threads=1, num_kv_blocks=64)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "1 2 3 4 5"]
LOGPROB_TOL = 0.6
MEDIAN_TOL = 0.15


def _runner(llm: LLM):
    return llm.engine.model_executor.driver_worker.runner


def _linear_bytes(model) -> int:
    return sum(p.nbytes for m in model.modules() if isinstance(m, LinearBase) for p in m.parameters(recurse=False))


def _forced(llm: LLM, asks: list[list[int]]) -> list[dict[int, float]]:
    outs = llm.generate(asks, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    return [o.logprobs[0].top_logprobs for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """none's greedy continuations, the teacher-forced prefixes, their top log-probabilities, its bytes."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model, **ENGINE) as none:
        ids = [none.tokenizer.encode(p) for p in PROMPTS]
        cont = [o.token_ids for o in none.generate(ids, sp)]
        asks = [p + c[:i] for p, c in zip(ids, cont) for i in range(len(c))]
        model = _runner(none).model
        return asks, _forced(none, asks), _linear_bytes(model), weight_bytes(model)


def _compare(want, got) -> tuple[list[float], float]:
    """(|logprob difference| of none's top token at each position, the share of positions whose top tokens agree)."""
    diffs, agree = [], 0
    for w, g in zip(want, got):
        top = max(w, key=w.get)
        assert top in g, "none's greedy token left int8's top 5"
        diffs.append(abs(w[top] - g[top]))
        agree += max(g, key=g.get) == top
    return diffs, agree / len(want)


def test_int8_follows_none(tiny_model, reference):
    asks, want, float_linear, float_total = reference
    with LLM(tiny_model, quantization="int8", **ENGINE) as q:
        runner = _runner(q)
        model = runner.model
        down = model.layers[0].mlp.down_proj
        assert isinstance(down.quant_method, Int8LinearMethod)
        assert down.weight.dtype == torch.int8 and down.weight_scale.dtype == torch.float32
        assert down.weight_scale.shape == (down.weight.shape[0],)
        assert down.cpu_kernels is not None  # the compiled kernel ran
        assert model.embed_tokens.weight.dtype == torch.float32
        assert runner.cpu_decode_step is None  # the one-call C++ decode step is float/GGUF only: per-layer calls
        # int8 weights plus a float32 scale a row: 1/4 + 1/K of float32's bytes.
        int8_linear = _linear_bytes(model)
        assert 0.25 <= int8_linear / float_linear <= 0.27
        assert weight_bytes(model) == float_total - float_linear + int8_linear
        got = _forced(q, asks)
    diffs, agree = _compare(want, got)
    worst, median = max(diffs), statistics.median(diffs)
    print(f"\nint8 vs none: logprob difference worst {worst:.4f}, median {median:.4f}; greedy agreement {agree:.1%}")
    assert worst <= LOGPROB_TOL and median <= MEDIAN_TOL
    assert agree >= 0.8


def test_torch_path_matches_kernels(tiny_model, reference):
    asks = reference[0][::3]
    with LLM(tiny_model, quantization="int8", **ENGINE) as q:
        kern = _forced(q, asks)
    with LLM(tiny_model, quantization="int8", cpu_kernels=False, **ENGINE) as q:
        assert _runner(q).model.layers[0].mlp.down_proj.cpu_kernels is None
        ref = _forced(q, asks)
    for a, b in zip(kern, ref):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t] == pytest.approx(b[t], abs=1e-4)


def test_config():
    assert Int8Config.from_config({}).get_name() == "int8"


# ---- greedy tokens against transformers at the same precision ----------------------


class W8A8Linear(torch.nn.Module):
    """transformers' nn.Linear as vLLM's W8A8 int8 defines it, written here
    apart from shoal's code: the weight quantized once per output channel,
    each call's input per token (symmetric, s = max|row| / 127 in float32,
    round half to even), the integer sums exact in float64, then scaled."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        s = w.abs().amax(1) / 127
        self.q_w = torch.round(w / torch.where(s == 0, torch.ones_like(s), s)[:, None]).clamp(-127, 127).double()
        self.s_w = s.double()
        self.bias = None if linear.bias is None else linear.bias.detach().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        s = rows.abs().amax(1) / 127
        q = torch.round(rows / torch.where(s == 0, torch.ones_like(s), s)[:, None]).clamp(-127, 127)
        y = ((q.double() @ self.q_w.T).float() * s[:, None]).double() * self.s_w
        if self.bias is not None:
            y = y + self.bias
        return y.float().reshape(*x.shape[:-1], -1)


@pytest.fixture(scope="module")
def hf_w8a8(tiny_model):
    """transformers' float model with every decoder layer's linear layers W8A8 (the LM head stays float, as shoal's)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for layer in hf.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, W8A8Linear(child))
    return hf


# Measured 2026-12-07: every prompt of every setting token for token (against float, 1 to 4 of 16).
# A token may differ only where transformers' top two logits are within REL_TIE of its top logit:
# the float parts of the two models round differently, and a row's quantization can round the other way.
REL_TIE = 1e-3


@pytest.mark.parametrize("setting", ["plain", "preempt", "chunked", "prefix"])
def test_int8_greedy_matches_transformers_w8a8(tiny_model, hf_w8a8, setting):
    from reference import hf_greedy
    from regimes import MAX_NEW, SETTINGS, prompts_for

    from shoal.benchmarks.tp import first_difference

    with LLM(tiny_model, quantization="int8", **SETTINGS[setting]) as llm:
        prompts = prompts_for(setting, hf_w8a8.config.vocab_size)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
        refs = hf_greedy(hf_w8a8, prompts, MAX_NEW, llm.engine.eos_token_ids)
    ties = []
    for prompt, out, ref in zip(prompts, outs, refs):
        if (diff := first_difference(hf_w8a8, prompt, out.token_ids, ref)) is None:
            continue
        i, gap = diff
        with torch.no_grad():
            top = hf_w8a8(torch.tensor([prompt + ref[:i]])).logits[0, -1].max().item()
        assert gap <= REL_TIE * abs(top), f"token {i} differs ({out.token_ids[i:]} vs {ref[i:]}): top-2 gap {gap:.3g}"
        ties.append(f"near-tie at token {i}: top-2 gap {gap:.3g} of {top:.3g}")
    for note in ties:
        warnings.warn(f"int8/{setting}: {note}", stacklevel=1)
    assert len(ties) <= len(prompts) // 4, ties
