"""A failure that can be pinned on one request fails that request alone;
one that cannot kills the engine, and the router never sends a request that
was on two dying workers to a third. Faults are injected through
workers/fault_injection.py (SHOAL_FAULT_INJECTION), read when an engine starts."""

from __future__ import annotations

import asyncio

import pytest
from test_failover import DyingWorkers, request, run, workers

from shoal.proto.errors import EngineFaultError
from shoal.proto.messages import GenerateRequest
from shoal.router.routing.failover import FailoverPool
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.fault_injection import ENV
from shoal.workers.model_executor.loader.detokenizer import IncrementalDetokenizer

POISON = 7  # a token id only the poisoned request's prompt holds


def _requests(n: int = 16) -> list[tuple[str, list[int], SamplingParams]]:
    """n requests of varied lengths, greedy and seeded, none holding POISON."""
    out = []
    for i in range(n):
        prompt = [20 + (i * 7 + j) % 400 for j in range(5 + 3 * i)]
        params = SamplingParams(
            max_tokens=12 + i % 5,
            ignore_eos=True,
            temperature=0 if i % 2 else 0.8,
            seed=1000 + i,
            top_k=40 if i % 3 == 0 else -1,
            logprobs=2 if i % 4 == 0 else None,
        )
        out.append((f"r{i}", prompt, params))
    return out


def _drain(engine: LLMEngine, reqs) -> dict[str, list]:
    for rid, prompt, params in reqs:
        engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params))
    got: dict[str, list] = {rid: [] for rid in engine.requests}
    errors: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    return got, errors


def test_a_request_whose_sampling_raises_fails_alone(tiny_model, monkeypatch):
    reqs = _requests()
    ref, ref_errors = _drain(LLMEngine(model=tiny_model, num_kv_blocks=128), reqs)
    assert not ref_errors

    monkeypatch.setenv(ENV, f"request={POISON}")
    engine = LLMEngine(model=tiny_model, num_kv_blocks=128)
    poisoned = ("poison", [POISON] + reqs[3][1], SamplingParams(max_tokens=10, temperature=0.7, seed=5))
    # Joins the others' steps: it is added among them, and runs with all of them from its first step.
    got, errors = _drain(engine, reqs[:8] + [poisoned] + reqs[8:])
    assert set(errors) == {"poison"}
    assert "injected sampling fault" in errors["poison"] and "poison" in errors["poison"]
    assert got.pop("poison") == []
    assert got == ref  # the 16 others: the tokens of the undisturbed run
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not engine.requests
    assert engine.num_finished_requests == 17


def test_a_request_whose_detokenizer_raises_fails_alone(tiny_model, monkeypatch):
    reqs = _requests(6)
    ref, _ = _drain(LLMEngine(model=tiny_model, num_kv_blocks=128), reqs)
    real_add = IncrementalDetokenizer.add

    def add(self, token, may_stop):
        if getattr(self, "_poisoned", False):
            raise UnicodeError("injected detokenizer fault")
        return real_add(self, token, may_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    engine = LLMEngine(model=tiny_model, num_kv_blocks=128)
    engine.add_request(GenerateRequest("bad-text", [30, 31, 32], SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.requests["bad-text"].detok._poisoned = True
    got, errors = _drain(engine, reqs)
    assert set(errors) == {"bad-text"} and "injected detokenizer fault" in errors["bad-text"]
    del got["bad-text"]
    assert got == ref
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_a_fault_no_request_can_be_blamed_for_kills_the_engine(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV, f"fatal={POISON}")
    engine = LLMEngine(model=tiny_model, num_kv_blocks=64)
    engine.add_request(GenerateRequest("ok", [30, 31], SamplingParams(max_tokens=4)))
    engine.add_request(GenerateRequest("fatal", [POISON, 30], SamplingParams(max_tokens=4)))
    with pytest.raises(EngineFaultError):
        engine.step()


def test_the_failed_request_gets_a_500_and_the_others_finish_over_http(tiny_model, monkeypatch):
    from serving import http_client, make_frontend

    monkeypatch.setenv(ENV, f"request={POISON}")

    async def main():
        fe = make_frontend(tiny_model, num_workers=1)
        async with http_client(fe) as client:
            body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
            good = [client.post("/v1/completions", json={**body, "prompt": [40 + i, 41, 42]}) for i in range(4)]
            bad = client.post("/v1/completions", json={**body, "prompt": [POISON, 41, 42]})
            rs = await asyncio.gather(bad, *good)
            after = await client.post("/v1/completions", json={**body, "prompt": "hello"})
        return rs, after, fe.pool.workers[0]

    (bad, *good), after, worker = asyncio.run(main())
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["code"] == "request_failed" and "injected sampling fault" in err["message"]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6 for r in good)
    assert after.status_code == 200 and worker.engine.failed is None


def test_a_request_that_kills_every_worker_it_lands_on_is_sent_to_two_at_most(tiny_model, monkeypatch, caplog):
    monkeypatch.setenv(ENV, f"fatal={POISON}")

    async def main():
        async with workers(tiny_model, n=3) as ws:
            pool = DyingWorkers(ws)  # sends to a live, healthy worker, as Serve does
            failover = FailoverPool(pool, backoff_s=0.01)
            poisoned = request(ws, "ignored", "poison", max_tokens=5)
            poisoned.prompt_token_ids = [POISON, 30, 31]
            got = [msg async for msg in failover.generate(poisoned)]
            after = await run(
                failover, request(ws, "The quick brown fox", "after", temperature=0, max_tokens=5, ignore_eos=True)
            )
            return got, after, pool, failover, [w.engine.failed is not None for w in ws]

    with caplog.at_level("WARNING", logger="shoal.router.routing.failover"):
        got, after, pool, failover, dead = asyncio.run(main())
    sent_to = [i for i, r in pool.sent if r.request_id.startswith("poison")]
    assert len(sent_to) == 2 and len(set(sent_to)) == 2  # two workers, never a third
    assert sum(dead) == 2 and failover.num_poisoned == 1
    assert len(got) == 1 and got[0].kind == "internal" and got[0].code == "poisoned_request"  # and no token
    assert len(after.tokens) == 5  # the third worker serves on
    assert any("poison" in r.getMessage() and "poisoned request" in r.getMessage() for r in caplog.records)


def test_the_client_of_a_poisoned_request_gets_a_500_poisoned_request(tiny_model, monkeypatch):
    from shoal.router.fronts.frontend import Frontend, ModelInfo, ServingError

    monkeypatch.setenv(ENV, f"fatal={POISON}")

    async def main():
        async with workers(tiny_model, n=2) as ws:
            info = ModelInfo.from_worker_info(ws[0].info(), 2)
            fe = Frontend(FailoverPool(DyingWorkers(ws), backoff_s=0.01), ws[0].engine.engine.tokenizer, info)
            with pytest.raises(ServingError) as e:
                async for _ in fe.generate([POISON, 30], SamplingParams(max_tokens=3), "cmpl-poison"):
                    pass
            return e.value

    err = asyncio.run(main())
    assert err.kind == "internal" and err.code == "poisoned_request" and "cmpl-poison" in err.message


def test_a_failed_requests_unwritten_blocks_leave_the_prefix_index(tiny_model, monkeypatch):
    """The blocks a failed step registered for its culprit were never known to be
    written: a later prompt with the same prefix recomputes them instead of reading them."""
    prefix = [30 + j % 300 for j in range(48)]  # three full blocks
    clean = (prefix + [11, 12, 13], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref = LLMEngine(model=tiny_model, num_kv_blocks=64)
    ref.add_request(GenerateRequest("clean", *clean))
    want = _drain(ref, [])[0]

    monkeypatch.setenv(ENV, f"request={POISON}")
    engine = LLMEngine(model=tiny_model, num_kv_blocks=64)
    got, errors = _drain(engine, [("poison", prefix + [POISON], SamplingParams(max_tokens=4))])
    assert set(errors) == {"poison"} and not engine.block_manager.pool.cached
    hits = engine.block_manager.pool.num_hit_tokens
    got, errors = _drain(engine, [("clean", *clean)])
    assert not errors and got == want and engine.block_manager.pool.num_hit_tokens == hits
