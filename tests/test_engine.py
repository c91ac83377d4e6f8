"""Engine behaviour beyond token equality: priority, dtypes, KV budgets,
loading, and the scheduler's step shape."""

from __future__ import annotations

import pytest
import torch

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLM, LLMEngine, SamplingParams


def test_priority_goes_first(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=64, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request(GenerateRequest("low", [5, 6, 7], p, priority=5))
    engine.add_request(GenerateRequest("high", [8, 9, 10], p, priority=0))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_fcfs_by_default(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=64, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(GenerateRequest(rid, [5, 6, 7], p))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a", "b", "c"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(tiny_model, dtype, monkeypatch):
    monkeypatch.setenv("SHOAL_CPU_BF16", "1")  # bfloat16 computed as such even on a CPU without it
    prompts = [[5, 6, 7, 8, 9] * k for k in (1, 4, 9)]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(tiny_model, dtype="float32", num_kv_blocks=64).generate(prompts, p)
    half = LLM(tiny_model, dtype=dtype, num_kv_blocks=64)
    assert half.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    out = half.generate(prompts, p)
    # The first token agrees unless the float32 top two are close.
    agree = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(ref, out))
    assert agree >= 2 and all(len(o.token_ids) == 8 for o in out)


def test_kv_budget_in_bytes(tiny_model):
    engine = LLMEngine(model=tiny_model, kv_cache_memory_bytes=1 << 20, block_size=16)
    # tiny model: 2 layers x 2 kv heads x 16 dims x 16 slots x 2 (k, v) x 4 bytes = 8 KiB a block
    assert engine.block_manager.num_total_blocks == (1 << 20) // (2 * 2 * 2 * 16 * 16 * 4)
    assert engine.runner.kv_cache.numel() * 4 == engine.block_manager.num_total_blocks * 8192


def test_prefix_caching_can_be_switched_off(tiny_model):
    shared = list(range(3, 100))
    p = SamplingParams(temperature=0, max_tokens=2)
    on = LLM(tiny_model, num_kv_blocks=64)
    on.generate([shared + [5], shared + [6]], p)
    off = LLM(tiny_model, num_kv_blocks=64, enable_prefix_caching=False)
    off.generate([shared + [5], shared + [6]], p)
    assert on.engine.stats().prefix_cache_hit_rate > 0.4
    assert off.engine.stats().prefix_cache_hit_rate == 0.0


def test_chunked_prefill_shares_the_step_with_decodes(tiny_model):
    engine = LLMEngine(model=tiny_model, num_kv_blocks=128, max_num_batched_tokens=32)
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request(GenerateRequest("short", [5, 6, 7], p))
    engine.step()  # short is now decoding
    engine.add_request(GenerateRequest("long", engine.tokenize(list(range(3, 300))), p))
    shapes = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        shapes.append(sorted(n for _, n in out.scheduled))
        return out

    engine.scheduler.schedule = recording_schedule
    for _ in range(5):
        engine.step()
    # every step: the decode (1 token) and a 31-token chunk of the long prompt
    assert all(shape == [1, 31] for shape in shapes), shapes


def test_stats_count_the_prompt_tokens_still_to_prefill(tiny_model):
    """num_waiting_tokens (what the request router weighs a queue by): a
    waiting request counts its prompt less the prefix cached when it came,
    a running one the rest of its chunked prompt, a decoding one nothing."""
    engine = LLMEngine(model=tiny_model, block_size=16, num_kv_blocks=128, max_num_batched_tokens=32, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    shared = list(range(3, 67))  # 64 tokens: 4 full blocks
    engine.add_request(GenerateRequest("first", shared + [99], p))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_waiting_tokens == 0
    engine.add_request(
        GenerateRequest("hit", engine.tokenize(shared + list(range(100, 110))), p)
    )  # 74 tokens, 64 of them cached
    engine.add_request(GenerateRequest("miss", engine.tokenize(list(range(200, 240))), p))  # 40 tokens
    assert engine.stats().num_waiting_tokens == 10 + 40
    engine.step()  # "hit" runs (one at a time): its 10 tokens in one step, then it decodes
    assert engine.stats().num_waiting_tokens == 40
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(GenerateRequest("long", engine.tokenize(list(range(300, 400))), p))
    engine.step()  # a 32-token chunk of 100
    assert engine.stats().num_waiting_tokens == 100 - 32


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a .gguf"):
        LLMEngine(model=str(tmp_path / "nope"))
