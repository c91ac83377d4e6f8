"""load_format "simulated": the real scheduler, block manager and prefix
cache over a stand-in model whose steps take a cost model's time."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import torch
from tiny_models import TINY_VOCAB, _train_tokenizer

from shoal.proto.messages import GenerateRequest
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.async_engine import AsyncEngine
from shoal.workers.core.sequence import RequestTimings, Sequence
from shoal.workers.model_executor.runner.model_runner import ModelRunner
from shoal.workers.model_executor.runner.simulated_runner import (
    DEFAULT_COST_MODEL,
    SimulatedRunner,
    StepCostModel,
    StepShape,
    fit_cost_model,
    load_cost_model,
    stand_in_token,
)

# SmolLM2-135M's shape (so a KV block has its real size), with the tiny tokenizer's vocabulary.
SMOL_SHAPE = dict(
    model_type="llama",
    vocab_size=TINY_VOCAB,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)
EOS = 2
FAST = StepCostModel(overhead_s=1e-3, prefill_s_per_token=2e-6, decode_s_per_seq=1e-4, decode_s_per_context_token=1e-7)


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory) -> str:
    """A folder with config.json and a tokenizer: no weights at all."""
    path = tmp_path_factory.mktemp("sim-model")
    (path / "config.json").write_text(json.dumps(SMOL_SHAPE))
    _train_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def fast_cost(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cost") / "step_cost.json"
    path.write_text(json.dumps({"cost_model": FAST.to_dict(), "cases": []}))  # shoal bench calibrate's layout
    return str(path)


def make_engine(sim_model: str, cost: str, **kw) -> LLMEngine:
    return LLMEngine(model=sim_model, load_format="simulated", simulated_cost_model=cost, **kw)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int] | str, SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(length)] for _ in range(n)]


def test_reads_no_weights_keeps_the_tokenizer_and_sizes_the_cache_as_asked(sim_model, fast_cost, monkeypatch):
    import shoal.workers.model_executor.runner.rank_worker as rank_worker

    def no_weights(*a, **k):
        raise AssertionError("a simulated engine read weights")

    monkeypatch.setattr(rank_worker, "model_weights", no_weights)
    monkeypatch.setattr(rank_worker, "build_model", no_weights)
    per_block = ModelRunner.kv_bytes_per_block(rank_worker.load_model_files(sim_model).config, 16, torch.float32)
    eng = make_engine(sim_model, fast_cost, kv_cache_memory_bytes=50 * per_block + 1)
    assert isinstance(eng.runner, SimulatedRunner) and eng.runner.cost == FAST
    assert eng.block_manager.num_total_blocks == eng.runner.num_blocks == 50  # the real block size counts
    by_blocks = make_engine(sim_model, fast_cost, num_kv_blocks=7, kv_cache_memory_bytes=1 << 40)
    assert by_blocks.stats().num_total_blocks == 7
    assert make_engine(sim_model, None).runner.cost == DEFAULT_COST_MODEL
    with pytest.raises(ValueError, match="one rank"):
        make_engine(sim_model, fast_cost, tensor_parallel_size=2)

    # Text in, text out; eos is never a stand-in token, so every request runs to max_tokens.
    eng.add_request(
        GenerateRequest("t", eng.tokenize("The quick brown fox"), SamplingParams(max_tokens=20, logprobs=2))
    )
    text, deltas = "", []
    while eng.has_unfinished_requests():
        for out in eng.step():
            text += out.new_text
            deltas.append(out)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 20
    assert text and EOS not in [t for d in deltas for t in d.new_token_ids]
    assert all(d.logprobs[0].logprob == 0.0 and d.logprobs[0].top_logprobs == {d.new_token_ids[0]: 0.0} for d in deltas)


def test_tokens_are_deterministic_per_seed_and_prompt(sim_model, fast_cost):
    ps = prompts(3, 20)
    reqs = {
        "seed7": (ps[0], SamplingParams(max_tokens=24, seed=7)),
        "seed7-other-prompt": (ps[1], SamplingParams(max_tokens=24, seed=7)),
        "seed8": (ps[0], SamplingParams(max_tokens=24, seed=8)),
        "greedy-a": (ps[2], SamplingParams(max_tokens=24, temperature=0)),
        "greedy-b": (ps[2], SamplingParams(max_tokens=24, temperature=0)),
        "greedy-c": (ps[1], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[5, 6])),
    }
    a = run(make_engine(sim_model, fast_cost), reqs)
    # Another engine, the requests one at a time: the same tokens (nothing depends on the batch).
    b = {}
    eng = make_engine(sim_model, fast_cost, seed=123)
    for rid, req in reversed(reqs.items()):
        b |= run(eng, {rid: req})
    assert a == b
    assert a["seed7"] == a["seed7-other-prompt"] != a["seed8"]  # a seeded stream is the seed's
    assert a["greedy-a"] == a["greedy-b"] != a["greedy-c"]  # a greedy one follows the prompt
    assert all(len(t) == 24 and EOS not in t for t in a.values())
    assert not {5, 6} & set(a["greedy-c"])
    assert stand_in_token(1, 0, 4, banned=[0, 1, 2]) == 3


def test_the_real_scheduler_preempts_when_the_cache_is_small(sim_model, fast_cost):
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=40, seed=i)) for i, p in enumerate(prompts(4, 40, seed=1))}
    roomy = make_engine(sim_model, fast_cost)
    small = make_engine(sim_model, fast_cost, num_kv_blocks=12)  # 4 x 5 blocks needed, 12 held
    want, got = run(roomy, reqs), run(small, reqs)
    assert roomy.stats().num_preemptions == 0 and small.stats().num_preemptions > 0
    assert got == want  # recomputed requests draw the same tokens
    assert small.stats().num_free_blocks == 12


def test_shared_prompts_hit_the_prefix_cache(sim_model, fast_cost):
    eng = make_engine(sim_model, fast_cost)
    shared = prompts(1, 64, seed=2)[0]
    eng.add_request(GenerateRequest("first", shared + [7], SamplingParams(max_tokens=4)))
    eng.step()  # its prefill registers the shared blocks
    outs = []
    for i in range(3):
        eng.add_request(GenerateRequest(f"later{i}", shared + [8 + i], SamplingParams(max_tokens=4)))
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    cached = {o.request_id: o.num_cached_tokens for o in outs}
    assert cached["first"] == 0 and all(cached[f"later{i}"] == 64 for i in range(3))
    assert eng.stats().prefix_cache_hit_rate > 0


def test_step_time_follows_the_cost_model(sim_model):
    cost = StepCostModel(
        overhead_s=0.05, prefill_s_per_token=1e-3, decode_s_per_seq=0.01, decode_s_per_context_token=1e-4
    )
    eng = LLMEngine(model=sim_model, load_format="simulated", max_num_batched_tokens=48)
    eng.runner.cost = cost
    slept, shapes = [], []
    eng.runner.sleep = slept.append  # record, do not wait
    execute = eng.runner.execute
    eng.runner.execute = lambda sched: (shapes.append(StepShape.of(sched.scheduled)), execute(sched))[1]
    ps = prompts(1, 30) + prompts(1, 70, seed=5) + prompts(1, 50, seed=6)
    run(eng, {f"r{i}": (p, SamplingParams(max_tokens=5)) for i, p in enumerate(ps)})
    want = [cost.step_seconds(s) for s in shapes]
    assert len(slept) == len(want) == eng.runner.num_steps == eng.num_steps
    assert eng.runner.simulated_seconds == pytest.approx(sum(want))
    # Each sleep is its step's time less the runner's own bookkeeping (well under a millisecond).
    assert all(w - 0.005 < s <= w for s, w in zip(slept, want))
    # Chunked prefill (48-token budget) and decodes both appear; the shape counts what attention reads.
    assert any(s.prefill_tokens and s.decode_seqs for s in shapes)
    params = SamplingParams()

    def seq(n: int, done: int) -> Sequence:
        return Sequence("x", [0] * n, n, params, 0, 0, RequestTimings(0.0), num_computed_tokens=done)

    assert StepShape.of([(seq(11, 10), 1), (seq(40, 8), 32), (seq(5, 4), 1)]) == StepShape(32, 2, 11 + 5)
    assert cost.step_seconds(StepShape(32, 2, 16)) == pytest.approx(0.05 + 0.032 + 0.02 + 0.0016)

    # With the real sleep, a step lasts at least its modelled time.
    eng = make_engine(sim_model, None)
    eng.runner.cost = FAST
    run(eng, {"w": (prompts(1, 30)[0], SamplingParams(max_tokens=10))})
    assert eng.step_seconds >= eng.runner.simulated_seconds > 0


CALIBRATION_LIKE = [
    StepShape(32),
    StepShape(128),
    StepShape(512),
    StepShape(0, 1, 65),
    StepShape(0, 8, 520),
    StepShape(0, 32, 2080),
    StepShape(0, 16, 12300),
]


def test_least_squares_recovers_known_coefficients():
    true = StepCostModel(0.03, 0.0025, 0.004, 2e-6)
    times = [true.step_seconds(s) for s in CALIBRATION_LIKE]
    assert fit_cost_model(CALIBRATION_LIKE, times).coefficients() == pytest.approx(true.coefficients(), rel=1e-6)
    # 2% noise moves each coefficient a little, never below zero.
    rng = random.Random(0)
    noisy = fit_cost_model(CALIBRATION_LIKE, [t * (1 + rng.uniform(-0.02, 0.02)) for t in times])
    assert noisy.coefficients() == pytest.approx(true.coefficients(), rel=0.3)
    assert noisy.overhead_s == pytest.approx(true.overhead_s, rel=0.1)
    # A feature no shape has gets 0; one whose best fit is negative is dropped and the rest refitted.
    prefills = [StepShape(n) for n in (10, 100, 1000)]
    only = fit_cost_model(prefills, [0.01 + 1e-4 * s.prefill_tokens for s in prefills])
    assert only.coefficients() == pytest.approx((0.01, 1e-4, 0.0, 0.0))
    falling = fit_cost_model(prefills, [0.03, 0.02, 0.01])
    assert falling.prefill_s_per_token == 0.0 and falling.overhead_s > 0
    with pytest.raises(ValueError):
        fit_cost_model(prefills, [0.1])


def test_cost_model_files(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"cost_model": FAST.to_dict(), "cases": []}))
    (tmp_path / "plain.json").write_text(json.dumps(FAST.to_dict()))
    assert load_cost_model(str(tmp_path / "bench.json")) == load_cost_model(str(tmp_path / "plain.json")) == FAST
    assert load_cost_model(None) == DEFAULT_COST_MODEL


def test_32_simulated_engines_share_one_process(sim_model, tmp_path):
    """The router's scale: 32 replicas, each an AsyncEngine thread that
    sleeps through its steps, on a CPU that could not serve two real ones."""
    cost = StepCostModel(overhead_s=0.02, prefill_s_per_token=2e-5, decode_s_per_seq=1e-3)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(cost.to_dict()))
    engines = [AsyncEngine(make_engine(sim_model, str(path), num_kv_blocks=256)) for _ in range(32)]
    ps = prompts(8, 48, seed=4)

    async def one(eng: AsyncEngine, i: int) -> int:
        n = 0
        async for out in eng.generate(
            GenerateRequest(f"r{i}", eng.engine.tokenize(ps[i % 8]), SamplingParams(max_tokens=32, seed=i))
        ):
            n += len(out.new_token_ids)
        return n

    async def main() -> list[int]:
        try:
            return await asyncio.gather(*(one(e, i) for e in engines for i in range(8)))
        finally:
            await asyncio.gather(*(e.shutdown() for e in engines))

    cpu0, t0 = time.process_time(), time.perf_counter()
    counts = asyncio.run(main())
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    assert counts == [32] * 256
    simulated = sum(e.engine.runner.simulated_seconds for e in engines)
    print(
        f"32 simulated engines: {wall:.2f} s wall, {cpu:.2f} s CPU ({cpu / wall:.2f} cores), "
        f"{simulated:.1f} s of simulated steps"
    )
    # Each engine's ~33 steps take ~1.2 s of modelled time: they ran side by side, not one after another.
    assert simulated > 10 * wall
    assert wall < 8 * simulated / 32
    assert cpu < 0.1 * simulated  # standing in costs a small share of the time it models
    assert not [t for t in threading.enumerate() if t.name == "shoal-engine-core"]
