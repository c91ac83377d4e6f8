"""Async scheduling's step ahead: the next step is scheduled while one
computes, each token it waits for held by a placeholder. The scheduler
then runs the same requests to the same tokens as one step at a time
(through prefill chunks, preemptions, stops and length caps), no prefix
key is made over a placeholder, and every block comes back; the engine's
replies match token for token, and a step that fails still fails its
culprit alone."""

from __future__ import annotations

import pytest

from shoal.proto.block_hash import chain_hashes
from shoal.proto.messages import GenerateRequest
from shoal.proto.sampling_params import SamplingParams
from shoal.workers import LLMEngine
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shoal.workers.core.sequence import PLACEHOLDER_TOKEN_ID, RequestTimings, Sequence, SequenceStatus
from shoal.workers.fault_injection import ENV

BS, EOS = 4, 0


def _token(seq: Sequence) -> int:
    """A made-up token fixed by the request and the draw's index (as a seeded
    sample is), read when the step is staged: it never needs the token before."""
    k = int(seq.request_id[1:]) * 31 + seq.num_output_tokens * 7
    return EOS if k % 23 == 0 else 1 + k % 40


def _staged(out: SchedulerOutput) -> ModelRunnerOutput:
    seqs = out.seqs_due_token
    return ModelRunnerOutput(seqs, [_token(s) for s in seqs], [None] * len(seqs))


def _scheduler(budget: int, blocks: int) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 8, 0, 1, 1), BlockManager(blocks, BS, True), 96, [EOS])


def _add_all(sched: Scheduler) -> list[Sequence]:
    seqs = []
    for i in range(12):
        prompt = [40 + (i % 3)] * 8 + [1 + (i * 5 + j) % 30 for j in range(3 + 2 * i)]  # shared first blocks
        params = SamplingParams(max_tokens=5 + (i * 3) % 11, min_tokens=2 if i % 4 == 0 else 0)
        seqs.append(Sequence(f"r{i}", prompt, len(prompt), params, i, 0, RequestTimings(0.0)))
        sched.add(seqs[-1])
    return seqs


def _check_keys(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Every key a sequence holds was made over real tokens: it is the key of
    those blocks' ids now, and none of the ids it stands for is a placeholder."""
    for seq in seqs:
        real = len(seq.token_ids) - seq.num_output_placeholders
        assert PLACEHOLDER_TOKEN_ID not in seq.token_ids[:real]
        assert all(t == PLACEHOLDER_TOKEN_ID for t in seq.token_ids[real:])
        n = len(seq.block_hashes)
        assert n * BS <= real
        assert seq.block_hashes == chain_hashes(seq.token_ids[:real], BS, num_blocks=n)


def _one_at_a_time(budget: int, blocks: int) -> tuple[dict, Scheduler]:
    sched = _scheduler(budget, blocks)
    seqs = _add_all(sched)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, _staged(out))
    return {s.request_id: (s.token_ids, s.finish_reason) for s in seqs}, sched


def _ahead(budget: int, blocks: int) -> tuple[dict, Scheduler, int]:
    """As the engine's pipeline runs them: step N+1 is scheduled and staged
    after N is launched (advance_ahead), before N's tokens are in."""
    sched = _scheduler(budget, blocks)
    seqs = _add_all(sched)
    inflight, num_ahead = None, 0
    while sched.has_unfinished() or inflight is not None:
        if inflight is None:
            out = sched.schedule()
            inflight = (out, _staged(out))
            sched.advance_ahead(out)
        cur, cur_out = inflight
        nxt = sched.schedule()
        inflight = None
        if not nxt.is_empty:
            inflight = (nxt, _staged(nxt))
            num_ahead += any(s.num_output_placeholders for s, _ in nxt.scheduled)
            sched.advance_ahead(nxt)
        sched.update_from_output(cur, cur_out, ahead=True)
        _check_keys(sched, seqs)
    return {s.request_id: (s.token_ids, s.finish_reason) for s in seqs}, sched, num_ahead


@pytest.mark.parametrize("budget,blocks", [(64, 256), (6, 256), (64, 14)])
def test_the_scheduler_runs_ahead_to_the_same_tokens(budget, blocks):
    """(roomy; prefill chunks of 6 tokens; so few blocks that sequences are
    preempted, some while their token is in flight)"""
    ref, ref_sched = _one_at_a_time(budget, blocks)
    got, sched, num_ahead = _ahead(budget, blocks)
    assert got == ref
    assert num_ahead > 10  # steps really read placeholders
    assert {r for r, (_, reason) in ref.items() if reason == "stop"}  # some ended on EOS, a step ahead of them
    if blocks == 14:
        assert ref_sched.num_preemptions and sched.num_preemptions
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not sched.running and not sched.waiting


def test_a_placeholders_block_enters_the_index_once_its_token_is_in():
    sched = _scheduler(64, 32)
    seq = Sequence("r1", [5, 6, 7], 3, SamplingParams(max_tokens=8), 0, 0, RequestTimings(0.0))
    sched.add(seq)
    first = sched.schedule()  # the prompt: its last token is due a token, the block's 4th
    sched.advance_ahead(first)
    assert seq.token_ids == [5, 6, 7, PLACEHOLDER_TOKEN_ID] and seq.num_computed_tokens == 3
    nxt = sched.schedule()  # computes the placeholder's slot, which fills block 0
    assert nxt.scheduled == [(seq, 1)]
    assert seq.num_registered_blocks == 0 and seq.block_hashes == []  # no key over a placeholder
    sched.advance_ahead(nxt)
    sched.update_from_output(first, ModelRunnerOutput([seq], [9], [None]), ahead=True)
    assert seq.token_ids == [5, 6, 7, 9, PLACEHOLDER_TOKEN_ID] and seq.num_output_placeholders == 1
    sched.update_from_output(nxt, ModelRunnerOutput([seq], [11], [None]), ahead=True)
    sched.schedule()  # the next allocation registers block 0, now whole
    assert seq.num_registered_blocks == 1 and seq.block_hashes == chain_hashes([5, 6, 7, 9], BS)


def test_a_sequence_at_its_length_cap_is_not_scheduled_ahead_and_ends_without_its_placeholder():
    sched = _scheduler(64, 32)
    capped = Sequence("r1", [5, 6, 7], 3, SamplingParams(max_tokens=1), 0, 0, RequestTimings(0.0))
    aborted = Sequence("r2", [5, 6, 8], 3, SamplingParams(max_tokens=9), 1, 0, RequestTimings(0.0))
    sched.add(capped)
    sched.add(aborted)
    first = sched.schedule()
    sched.advance_ahead(first)
    nxt = sched.schedule()
    assert [s for s, _ in nxt.scheduled] == [aborted]  # its one token is in flight: nothing more to compute
    sched.advance_ahead(nxt)
    sched.finish(aborted, "abort")  # between steps, with two tokens in flight
    assert aborted.token_ids == [5, 6, 8] and aborted.num_output_placeholders == 0
    done = sched.update_from_output(first, ModelRunnerOutput([capped, aborted], [9, 9], [None, None]), ahead=True)
    assert done == [capped] and capped.token_ids == [5, 6, 7, 9] and capped.finish_reason == "length"
    assert aborted.token_ids == [5, 6, 8] and aborted.status is SequenceStatus.FINISHED  # its row is dropped
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def _requests() -> list[tuple[str, str, SamplingParams]]:
    """Greedy, seeded with logprobs, min_tokens with stop strings, length caps,
    and penalties (which make their steps wait for their tokens)."""
    out = []
    for i in range(14):
        prompt = f"Item {i}: the quick brown fox" + " jumps" * (i % 5)
        if i % 4 == 0:
            params = SamplingParams(temperature=0, max_tokens=6 + i)
        elif i % 4 == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, logprobs=2)
        elif i % 4 == 2:
            params = SamplingParams(temperature=0, max_tokens=16, min_tokens=3, stop=["e"], ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=1 + i % 3)
        out.append((f"q{i}", prompt, params))
    out.append(("penalized", "Item: the fox", SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3)))
    return out


def _drain(engine: LLMEngine) -> dict:
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens, text, _, lps = got.setdefault(d.request_id, [[], "", None, []])
            tokens += d.new_token_ids
            got[d.request_id][1] += d.new_text
            got[d.request_id][2] = (d.finish_reason, d.stop_reason, d.num_output_tokens)
            # (to 3 places: batches that differ round differently)
            lps += [(lp.token_id, round(lp.logprob, 3)) for lp in d.logprobs or []]
    return got


@pytest.mark.parametrize("num_kv_blocks", [256, 12])
def test_the_engine_replies_the_same_with_steps_ahead(tiny_model, num_kv_blocks):
    runs = {}
    for on in (False, True):
        engine = LLMEngine(model=tiny_model, num_kv_blocks=num_kv_blocks, num_threads=1, async_scheduling=on)
        for rid, prompt, params in _requests():
            engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params))
        runs[on] = _drain(engine)
        if on:
            assert engine.pipeline is not None and engine.pipeline.num_ahead > 5
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks and not engine.requests
        engine.shutdown()
    assert runs[True] == runs[False]
    assert all(len(t) == n for t, _, (_, _, n), _ in runs[False].values())  # usage counts the tokens sent


def _run_with_a_latecomer(tiny_model: str, on: bool, reqs, params, late: tuple[str, list[int]] | None, at: int):
    """Drain an engine (async scheduling on or off) over reqs; `late` joins after
    step `at`, while steps run ahead of the others. (tokens, errors) by request."""
    engine = LLMEngine(model=tiny_model, num_kv_blocks=128, num_threads=1, async_scheduling=on)
    for rid, prompt in reqs:
        engine.add_request(GenerateRequest(rid, prompt, params))
    got: dict[str, list] = {}
    errors: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.error is not None:
                errors[d.request_id] = d.error
        steps += 1
        if steps == at and late is not None:
            engine.add_request(GenerateRequest(late[0], late[1], params))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not engine.requests
    engine.shutdown()
    return got, errors


def test_a_step_ahead_that_fails_fails_its_culprit_alone(tiny_model, monkeypatch):
    poison = 7
    reqs = [(f"r{i}", [20 + (i * 7 + j) % 400 for j in range(5 + 3 * i)]) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, ref_errors = _run_with_a_latecomer(tiny_model, False, reqs, params, None, 3)
    monkeypatch.setenv(ENV, f"request={poison}")
    # it fails in a step launched ahead of the others
    got, errors = _run_with_a_latecomer(tiny_model, True, reqs, params, ("poison", [poison, 21, 22]), 3)
    assert not ref_errors and set(errors) == {"poison"} and "injected sampling fault" in errors["poison"]
    assert got.pop("poison", []) == []
    assert got == ref


def test_a_request_whose_staging_raises_fails_alone_with_steps_ahead(tiny_model, monkeypatch):
    """Staging happens off the compute thread when steps run ahead: a request
    whose inputs cannot be staged (here, its sampling settings) still fails
    alone, as it does one step at a time, and the others keep their tokens."""
    from shoal.workers.model_executor.runner import model_runner

    real = model_runner.stage_sampling_metadata

    def stage(seqs, *args, **kwargs):
        if any(s.request_id == "bad" for s in seqs):
            raise ValueError("injected staging fault")
        return real(seqs, *args, **kwargs)

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [(f"r{i}", [30 + (i * 11 + j) % 300 for j in range(4 + 5 * i)]) for i in range(5)]
    ref, _ = _run_with_a_latecomer(tiny_model, False, reqs, params, None, 2)
    monkeypatch.setattr(model_runner, "stage_sampling_metadata", stage)
    for on in (False, True):
        got, errors = _run_with_a_latecomer(tiny_model, on, reqs, params, ("bad", [41, 42, 43]), 2)
        assert set(errors) == {"bad"} and "injected staging fault" in errors["bad"], on
        assert got.pop("bad", []) == []
        assert got == ref, on
