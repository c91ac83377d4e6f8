"""Parallel sampling: `n` choices (and `best_of` on completions) as sibling
engine requests that share one prefill of the prompt, in the engine, the
request router and the OpenAI app."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import http_client, make_frontend
from stand_in import stand_in_step
from test_block_invariants import BS, check

from shoal.proto.errors import InvalidRequestError
from shoal.proto.messages import GenerateRequest
from shoal.router.routing import policies
from shoal.router.routing.replica_stats import ReplicaStats
from shoal.workers import LLMEngine, SamplingParams
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.scheduler import Scheduler, SchedulerConfig
from shoal.workers.core.sequence import RequestTimings, Sequence

PROMPT_IDS = [(7 * i + 3) % 500 for i in range(40)]  # two full 16-token blocks and 8 tokens more
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1234)
PROMPT = "The quick brown fox"


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(model=model, num_kv_blocks=64, num_threads=1, **kw)


def _record_steps(engine: LLMEngine) -> list[list[tuple[str, int]]]:
    """Each step's (request id, tokens computed), as the scheduler hands them out."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(seq.request_id, n) for seq, n in out.scheduled])
        return out

    engine.scheduler.schedule = recording
    return steps


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _alone(model: str, seed: int) -> list[int]:
    """The run of one seed by itself, in an engine with no prefix cache."""
    engine = _engine(model, enable_prefix_caching=False)
    engine.add_request(GenerateRequest("alone", PROMPT_IDS, dataclasses.replace(SAMPLED, seed=seed)))
    return _drain(engine)["alone"]


def test_n4_prefills_once_shares_the_prompt_blocks_and_each_child_is_its_seed_alone(tiny_model):
    refs = [_alone(tiny_model, SAMPLED.seed + k) for k in range(4)]
    for caching in (True, False):
        engine = _engine(tiny_model, enable_prefix_caching=caching)
        steps = _record_steps(engine)
        for k in range(4):
            params = dataclasses.replace(SAMPLED, seed=SAMPLED.seed + k)
            engine.add_request(GenerateRequest(f"r-{k}", PROMPT_IDS, params, parent_request_id="r-0"))
        made = engine.step()
        # One prefill: each sibling computes only the tokens past the two full blocks it takes from
        # the first, in the same step (which writes them before any attention reads them).
        assert steps[0] == [("r-0", 40), ("r-1", 8), ("r-2", 8), ("r-3", 8)]
        assert sorted(out.request_id for out in made) == ["r-0", "r-1", "r-2", "r-3"]
        seqs = [engine.requests[f"r-{k}"].seq for k in range(4)]
        shared = seqs[0].block_table[:2]
        assert all(s.block_table[:2] == shared for s in seqs)
        assert [engine.block_manager.pool.blocks[b].ref_cnt for b in shared] == [4, 4]
        assert len({b for s in seqs for b in s.block_table[2:]}) == sum(len(s.block_table) - 2 for s in seqs)
        assert [s.num_cached_tokens for s in seqs] == [0, 32, 32, 32]
        rest = _drain(engine)
        assert sum(n for step in steps for rid, n in step if n > 1) == 40 + 3 * 8  # not 4 x 40
        outputs = {f"r-{k}": [] for k in range(4)}
        for out in made:
            outputs[out.request_id] += out.new_token_ids
        assert [outputs[f"r-{k}"] + rest[f"r-{k}"] for k in range(4)] == refs
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks and not engine.scheduler.groups


def test_siblings_go_on_alone_when_the_leader_ends_before_its_prompt_is_computed(tiny_model):
    refs = [_alone(tiny_model, SAMPLED.seed + k) for k in range(3)]
    engine = _engine(tiny_model, max_num_batched_tokens=16)  # the prompt takes three steps
    steps = _record_steps(engine)
    for k in range(3):
        engine.add_request(
            GenerateRequest(
                f"r-{k}", PROMPT_IDS, dataclasses.replace(SAMPLED, seed=SAMPLED.seed + k), parent_request_id="g"
            )
        )
    assert engine.step() == []  # a prefill chunk: no token yet
    assert steps[0] == [("r-0", 16)]
    engine.abort_request("r-0")
    out = _drain(engine)
    assert [out[f"r-{k}"] for k in (1, 2)] == refs[1:]
    # r-1 took over: it prefilled the rest (its first block from the cache r-0 left); r-2 joined
    # the step that completed it.
    assert steps[1:3] == [[("r-1", 16)], [("r-1", 8), ("r-2", 8)]]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


group_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    ops=st.lists(group_op, max_size=60),
    num_blocks=st.integers(16, 40),
    budget=st.integers(4, 64),
    caching=st.booleans(),
)
def test_groups_keep_the_pool_consistent_through_preemption_and_aborts(ops, num_blocks, budget, caching):
    """Random groups of siblings, steps and aborts under a small cache
    (preemptions): shared blocks are counted once per holder, and every
    sequence finishes (no sibling waits forever)."""
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs=8), bm, max_model_len=1 << 20, eos_token_ids=[])
    live: list[Sequence] = []
    n = 0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, width = o
            toks = [(n * 7 + k) % 50 for k in range(plen)]
            if bm.blocks_needed(len(toks) + max_tokens) > num_blocks:
                continue  # the engine refuses these at submission
            for k in range(width):
                s = Sequence(
                    f"{n}-{k}", list(toks), len(toks), SamplingParams(max_tokens=max_tokens), n, 0, RequestTimings(0.0)
                )
                s.arrival_order = n * 8 + k
                s.parent_request_id = str(n)
                sched.add(s)
                live.append(s)
            n += 1
        elif o[0] == "step":
            for s in stand_in_step(sched, budget_check=budget):
                live.remove(s)
        elif live:
            s = live.pop(o[1] % len(live))
            sched.finish(s, "abort")
        check(bm, live)
    for _ in range(4000):
        if not sched.has_unfinished():
            break
        for s in stand_in_step(sched, budget_check=budget):
            live.remove(s)
        check(bm, live)
    assert not sched.has_unfinished() and not sched.groups
    assert bm.num_free_blocks == num_blocks


def test_the_request_router_sends_a_group_where_its_first_member_went():
    stats, names = ReplicaStats(), ["a", "b", "c"]
    stats.block_size = 16

    def req(rid: str) -> GenerateRequest:
        return GenerateRequest(rid, [1, 2, 3], SamplingParams(), parent_request_id="x-0")

    figs = lambda: [stats.get(n) for n in names]  # noqa: E731
    rr = policies.get_policy("round-robin")
    firsts = [policies.route(stats, rr, req(f"x-{k}"), names, figs(), turn=k + 1)[0] for k in range(3)]
    assert firsts == [1, 1, 1]  # round-robin would have said 1, 2, 0
    other = policies.route(stats, rr, GenerateRequest("y", [1], SamplingParams()), names, figs(), turn=2)
    assert other[0] == 2
    for k in range(3):
        stats.done(f"x-{k}")
    stats.done("y")
    assert stats.group_replica("x-0") is None and stats.num_request_entries() == 0


def _events(body: str) -> list:
    lines = [ln[len("data: ") :] for ln in body.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _recording(generate, worker: int, went: dict):
    def wrapped(request):
        went[request.request_id] = worker
        return generate(request)

    return wrapped


def test_n_choices_whole_and_streamed_equal_their_seeds_alone_with_the_prompt_counted_once(tiny_model):
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": 77}

    async def main():
        fe = make_frontend(tiny_model, num_workers=2, num_threads=1)
        fe.pool.policy = policies.get_policy("round-robin")  # would spread the siblings, but for the group's pin
        for i, w in enumerate(fe.pool.workers):
            w.generate = _recording(w.generate, i, went)
        async with http_client(fe) as c:
            whole = (await c.post("/v1/completions", json=dict(body, n=3))).json()
            alone = [(await c.post("/v1/completions", json=dict(body, seed=77 + k))).json() for k in range(3)]
            long = (await c.post("/v1/completions", json=dict(body, prompt=PROMPT_IDS, n=4))).json()
            opts = {"include_usage": True}
            streamed = await c.post("/v1/completions", json=dict(body, n=3, stream=True, stream_options=opts))
            chat = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 4, "stream": True},
            )
            two = (await c.post("/v1/completions", json=dict(body, prompt=[PROMPT, [5, 6, 7]], n=2))).json()
        return whole, alone, long, streamed, chat, two

    went: dict[str, int] = {}  # engine request id -> the worker it went to
    whole, alone, long, streamed, chat, two = asyncio.run(main())
    n_prompt = alone[0]["usage"]["prompt_tokens"]
    alone = [a["choices"][0]["text"] for a in alone]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["text"] for c in whole["choices"]] == alone
    assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * 3
    usage = whole["usage"]
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 24
    assert usage["total_tokens"] == n_prompt + 24
    # The siblings took the prompt's two full blocks from the first sample, which found none cached.
    assert long["usage"]["prompt_tokens"] == 40 and long["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    chunks = _events(streamed.text)
    texts = ["", "", ""]
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == alone
    finishes = {ch["choices"][0]["index"]: ch["choices"][0]["finish_reason"] for ch in chunks[:-1]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"]["prompt_tokens"] == n_prompt and chunks[-1]["usage"]["completion_tokens"] == 24
    roles = [ch["choices"][0]["index"] for ch in _events(chat.text) if ch["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"][:2]] == alone[:2]
    assert two["usage"]["prompt_tokens"] == n_prompt + 3 and two["usage"]["completion_tokens"] == 32
    # Each prompt's samples ran on one worker, though round-robin sent the n=1 runs to both.
    for rid in (whole["id"], _events(streamed.text)[0]["id"], _events(chat.text)[0]["id"]):
        assert len({w for r, w in went.items() if r.startswith(rid + "-")}) == 1
    assert len({w for r, w in went.items() if r.startswith(f"{two['id']}-") and r[-1] in "01"}) == 1
    assert len({w for r, w in went.items() if r.startswith(f"{two['id']}-") and r[-1] in "23"}) == 1
    assert len(set(went.values())) == 2


def test_best_of_returns_the_likeliest_samples_and_counts_every_one(tiny_model):
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "seed": 5}

    async def main():
        fe = make_frontend(tiny_model, num_threads=1)
        async with http_client(fe) as c:
            ranked = (await c.post("/v1/completions", json=dict(body, n=4, logprobs=0))).json()
            best = (await c.post("/v1/completions", json=dict(body, n=2, best_of=4))).json()
            with_lp = (await c.post("/v1/completions", json=dict(body, n=1, best_of=4, logprobs=1))).json()
        return ranked, best, with_lp

    ranked, best, with_lp = asyncio.run(main())
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in ranked["choices"]]
    order = sorted(range(4), key=lambda k: -scores[k])
    assert [c["text"] for c in best["choices"]] == [ranked["choices"][k]["text"] for k in order[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # asked for none
    assert best["usage"]["completion_tokens"] == 4 * 6  # every sample run
    assert best["usage"]["prompt_tokens"] == ranked["usage"]["prompt_tokens"]
    (top,) = with_lp["choices"]
    assert top["text"] == ranked["choices"][order[0]]["text"] and len(top["logprobs"]["tokens"]) == 6


def test_bad_n_and_best_of_get_400_naming_the_field(tiny_model):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),  # past --max-n (16)
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/chat/completions", dict(chat, n=17), "n"),
        ("/v1/completions", {"prompt": "hi", "best_of": 17}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
        ("/v1/chat/completions", dict(chat, best_of=2), "best_of"),
    ]

    async def main():
        fe = make_frontend(tiny_model, num_threads=1, max_n=16)
        async with http_client(fe) as c:
            answers = [await c.post(path, json=body) for path, body, _ in cases]
            good = await c.post("/v1/completions", json={"prompt": "hi", "n": 16, "max_tokens": 1})
        return answers, good, fe

    answers, good, fe = asyncio.run(main())
    for (_, body, param), r in zip(cases, answers):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert param in r.json()["error"]["message"]
    assert good.status_code == 200 and len(good.json()["choices"]) == 16 and fe.num_in_flight == 0


def test_the_engine_refuses_a_group_larger_than_max_n(tiny_model):
    """The router bounds n by --max-n; the engine bounds a group by it too, whoever sends it."""
    engine = _engine(tiny_model, max_n=3)
    for k in range(3):
        engine.add_request(GenerateRequest(f"r-{k}", PROMPT_IDS, SAMPLED, parent_request_id="g"))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(GenerateRequest("r-3", PROMPT_IDS, SAMPLED, parent_request_id="g"))
    assert e.value.field == "n" and "r-3" not in engine.requests
    engine.add_request(GenerateRequest("other", PROMPT_IDS, SAMPLED, parent_request_id="h"))  # another group is its own
    assert set(_drain(engine)) == {"r-0", "r-1", "r-2", "other"}
