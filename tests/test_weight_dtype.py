"""--weight-dtype bfloat16: the weight matrices stored in bfloat16 under a
float32 model, against the same model in float32.

Tolerances (stated, and met with room on the default model): the top-5
log-probabilities of each step differ by at most 0.25 nats while both runs
are on the same tokens, and at least 85% of greedy tokens equal float32's
(8 prompts x 32 tokens; 93% when measured)."""

from __future__ import annotations

import pytest
import torch

from shoal.workers import LLM, SamplingParams
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

CPU = torch.device("cpu")


def test_args_resolve_and_refuse_what_has_no_path():
    assert EngineArgs().resolved_weight_dtype(CPU) == torch.float32
    assert EngineArgs(weight_dtype="bfloat16").resolved_weight_dtype(CPU) == torch.bfloat16
    # Already bfloat16 throughout: nothing to narrow.
    assert EngineArgs(dtype="bfloat16", weight_dtype="bfloat16").resolved_weight_dtype(CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="CPU option"):
        EngineArgs(dtype="float32", weight_dtype="bfloat16").resolved_weight_dtype(torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU option"):
        EngineArgs(dtype="float16", weight_dtype="bfloat16").resolved_weight_dtype(CPU)
    with pytest.raises(ValueError, match="weight_dtype must be"):
        EngineArgs(weight_dtype="int8").resolved_weight_dtype(CPU)


def first_steps_logprobs(out) -> list[dict[int, float]]:
    return [lp.top_logprobs for lp in out.logprobs]


def compare(ref, got) -> tuple[float, int]:
    """(largest top-5 logprob gap while both runs agree, greedy tokens equal by position)."""
    worst, equal = 0.0, 0
    for a, b in zip(ref, got):
        equal += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        for i, (la, lb) in enumerate(zip(first_steps_logprobs(a), first_steps_logprobs(b))):
            if a.token_ids[:i] != b.token_ids[:i]:
                break  # different contexts from here on
            for tok, lp in la.items():
                if tok in lb:
                    worst = max(worst, abs(lp - lb[tok]))
    return worst, equal


def test_tiny_model_stores_matrices_in_bfloat16_and_computes_in_float32(tiny_model):
    prompts = ["The quick brown fox", "Paged attention keeps", "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    ref = LLM(tiny_model, num_kv_blocks=64)
    want = ref.generate(prompts, params)
    ref.shutdown()
    # float32 named: under auto a CPU with bfloat16 arithmetic computes in it (platforms/cpu/precision.py)
    llm = LLM(tiny_model, num_kv_blocks=64, dtype="float32", weight_dtype="bfloat16")
    model = llm.engine.runner.model
    mats = [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert mats and all(w.dtype == torch.bfloat16 for w in mats)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    assert llm.engine.runner.kv_cache.dtype == torch.float32 and model.dtype == torch.float32
    got = llm.generate(prompts, params)
    assert llm.engine.runner.cpu_decode_step._bound is not None, "the decode steps did not take the compiled layers"
    llm.shutdown()
    worst, _ = compare(want, got)
    assert worst <= 0.25, f"top-5 logprobs moved by {worst:.3f} nats"


@pytest.mark.slow
def test_default_model_in_bfloat16_weights_stays_close_to_float32():
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three laws of robotics are",
        "List five fruits:",
        "Explain photosynthesis in one sentence.",
        "SELECT name FROM users WHERE",
    ]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)
    outs = {}
    for weight_dtype in ("auto", "bfloat16"):
        llm = LLM(dtype="float32", weight_dtype=weight_dtype)
        outs[weight_dtype] = llm.generate(prompts, params)
        llm.shutdown()
    worst, equal = compare(outs["auto"], outs["bfloat16"])
    total = sum(len(o.token_ids) for o in outs["auto"])
    assert worst <= 0.25, f"top-5 logprobs moved by {worst:.3f} nats"
    assert equal / total >= 0.85, f"only {equal}/{total} greedy tokens equal float32's"
