"""`shoal bench routing`: its workloads, its ideal cache, its figures, and
(slow tier) a tiny end-to-end run on two simulated workers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from shoal.benchmarks import routing
from shoal.benchmarks import routing_workloads as wl
from shoal.proto.block_hash import chain_hashes
from shoal.proto.utils import cdiv

VOCAB = wl.Vocab(49152, (2,))  # the default model's
BS = 16


def _shared(kind="shared", rate=2.0, duration=300.0, seed=0, sizes=None):
    return wl.make_workload(kind, rate, duration, seed, VOCAB, sizes or wl.WorkloadSizes())


@pytest.mark.parametrize("kind", wl.WORKLOADS)
def test_workloads_are_seeded_poisson_arrivals(kind):
    a, b = _shared(kind, seed=3, duration=150), _shared(kind, seed=3, duration=150)
    assert a == b
    assert _shared(kind, seed=4, duration=150) != a
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 150
    assert abs(len(a) - 300) < 5 * math.sqrt(300)  # 2/s for 150 s, Poisson
    gaps = [t1 - t0 for t0, t1 in zip(times, times[1:])]
    assert 0.4 < sum(gaps) / len(gaps) < 0.6 and max(gaps) > 4 * min(gaps)
    assert all(0 <= t < VOCAB.size for r in a for t in r.prompt)
    assert all(VOCAB.first <= t for r in a if r.turn == 0 for t in r.prompt)  # replies may hold any id
    assert all(len(r.prompt) + r.max_tokens <= wl.WorkloadSizes().max_context for r in a)


def test_a_chat_turn_extends_the_previous_turn_and_its_reply():
    reqs = _shared()
    last: dict[int, wl.Request] = {}
    follow_ups = 0
    for r in reqs:
        prev = last.get(r.chat)
        if prev is None:
            assert r.turn == 0
        else:
            assert r.turn == prev.turn + 1 and r.group == prev.group
            head = prev.prompt + wl.reply_tokens(prev, VOCAB)
            assert r.prompt[: len(head)] == head and len(r.prompt) > len(head)
            follow_ups += 1
        last[r.chat] = r
    assert sorted({r.group for r in reqs}) == list(range(8))
    assert follow_ups > len(reqs) / 2  # mostly multi-turn
    # The 8 system prompts are 1-2k tokens: what the first turns on one have in common.
    firsts: dict[int, list[list[int]]] = {}
    for r in reqs:
        if r.turn == 0:
            firsts.setdefault(r.group, []).append(r.prompt)
    assert all(len(p) >= 3 for p in firsts.values())
    for prompts in firsts.values():
        n = min(next(i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y) for p in prompts[1:])
        assert 1024 <= n <= 2048


def test_the_reply_is_what_a_simulated_worker_generates():
    from shoal.workers.model_executor.runner.simulated_runner import stand_in_token

    r = wl.Request(0.0, [5, 6, 7], 6, seed=12345)
    assert wl.reply_tokens(r, VOCAB) == [stand_in_token(12345, i, VOCAB.size, (2,)) for i in range(6)]
    assert 2 not in wl.reply_tokens(wl.Request(0.0, [1], 200, seed=7), wl.Vocab(3, (2,)))


def test_shared_prefixes_need_several_times_one_worker_cache():
    sizes = wl.WorkloadSizes()
    blocks, ws = wl.worker_blocks(sizes, VOCAB, BS, cache_factor=4.0)
    assert ws >= 4.0 * blocks - 1e-9 and blocks >= cdiv(sizes.max_context, BS)
    # Not even the system prompts alone fit one worker; all of it fits the workers together.
    systems = {r.group: r for r in _shared() if r.turn == 0}
    assert len(systems) == 8
    assert 8 * sizes.system_tokens[0] // BS > blocks
    assert ws < 16 * blocks
    # The working set is per arrival: about the same at another rate.
    assert wl.working_set_blocks(_shared(rate=8.0, duration=100), VOCAB, BS) == pytest.approx(ws, rel=0.25)


def test_output_lengths_are_heavy_tailed():
    import random

    sizes = wl.WorkloadSizes()
    rng = random.Random(0)
    outs = sorted(wl.output_length(sizes, rng) for _ in range(5000))
    n = len(outs)
    p50, p99, mean = outs[n // 2], outs[int(0.99 * n)], sum(outs) / n
    assert p99 >= 5 * p50 and mean > 1.3 * p50
    assert outs[0] >= 1 and outs[-1] == sizes.output_max  # the cap is reached
    # The workloads' requests draw theirs so.
    reqs = _shared("unique", duration=100)
    theirs = sorted(r.max_tokens for r in reqs)
    assert theirs[int(0.99 * len(theirs))] >= 5 * theirs[len(theirs) // 2]


def test_unique_shares_no_prefix_and_hot_has_one_prompt_take_most():
    unique = _shared("unique")
    firsts = [chain_hashes(r.prompt[:BS], BS)[0] for r in unique]
    assert len(set(firsts)) == len(firsts)
    assert wl.working_set_blocks(unique, VOCAB, BS) == 0
    assert wl.replay(unique, 100_000, BS, VOCAB).hit_rate == 0.0

    def top_share(reqs):
        counts = [sum(r.group == g for r in reqs) for g in range(8)]
        return max(counts) / len(reqs)

    assert top_share(_shared("hot")) > 0.6
    assert top_share(_shared("shared")) < 0.3


def test_the_replay_counts_hits_as_the_engine_would():
    a = wl.Request(0.0, list(range(100, 164)), 8, seed=1)  # 4 full blocks
    again = wl.Request(1.0, list(range(100, 164)), 8, seed=2)
    follow = wl.Request(2.0, a.prompt + wl.reply_tokens(a, VOCAB) + [9] * 30, 4, seed=3)
    res = wl.replay([a, again, follow], 64, BS, VOCAB)
    # The same 64 tokens: 3 blocks hit (the last token is always computed); the follow-up
    # holds a's prompt and reply (72 tokens: 4 full blocks cached) then its own.
    assert res.per_request == [0, 48, 64]
    assert res.prompt_tokens == 64 + 64 + 102 and res.hit_rate == pytest.approx(112 / 230)
    # Replies that the next turn does not repeat (real workers): the prompt's blocks only.
    assert wl.replay([a, again, follow], 64, BS, VOCAB, replies_known=False).per_request == [0, 48, 64]
    a72 = wl.Request(0.0, list(range(100, 180)), 17, seed=1)  # 5 blocks; the reply's first 16 tokens fill a 6th
    f72 = wl.Request(1.0, a72.prompt + wl.reply_tokens(a72, VOCAB) + [9] * 20, 4, seed=3)
    assert wl.replay([a72, f72], 64, BS, VOCAB).per_request == [0, 96]
    assert wl.replay([a72, f72], 64, BS, VOCAB, replies_known=False).per_request == [0, 80]
    # Two caches, each request to the other one: nothing hits.
    assert wl.replay([a, again], 64, BS, VOCAB, assign=[0, 1], num_caches=2).per_request == [0, 0]
    # A cache that cannot keep a's blocks while `other` runs: evicted, no hit.
    other = wl.Request(0.5, list(range(1000, 1064)), 8, seed=4)
    assert wl.replay([a, other, again], 5, BS, VOCAB).per_request == [0, 0, 0]
    assert wl.replay([a, other, again], 10, BS, VOCAB).per_request == [0, 0, 48]
    # The ideal rate over a subset: the replay sees everything, only `counted` is scored.
    assert wl.ideal_hit_rate([a, again, follow], 64, BS, VOCAB, counted=[1]) == pytest.approx(48 / 64)
    with pytest.raises(ValueError, match="does not fit"):
        wl.replay([a], 4, BS, VOCAB)


def test_routing_by_prefix_beats_random_on_shared_by_the_hit_rate_goal():
    """Offline: the cache sizes make the goal reachable and random routing miss."""
    import random

    reqs = _shared(rate=3.0, duration=200)
    blocks, _ = wl.worker_blocks(wl.WorkloadSizes(), VOCAB, BS, 4.0)
    rng = random.Random(0)
    ideal = wl.replay(reqs, 16 * blocks, BS, VOCAB).hit_rate
    rand = wl.replay(reqs, blocks, BS, VOCAB, assign=[rng.randrange(16) for _ in reqs], num_caches=16).hit_rate
    home = {g: (2 * g, 2 * g + 1) for g in range(8)}
    sticky = wl.replay(
        reqs, blocks, BS, VOCAB, assign=[home[r.group][r.chat % 2] for r in reqs], num_caches=16
    ).hit_rate
    assert ideal > 0.85 and sticky >= 0.9 * ideal and sticky >= 3 * rand


def _outcome(ttft, e2e=1.0, status="ok", sent=0.0, out=10, prompt=100, cached=50):
    return routing.Outcome(status, sent, ttft, e2e, out, prompt, cached)


def test_summary_counts_add_up_and_skip_the_warmup():
    reqs = [wl.Request(t, [1], 10, 0) for t in (0.5, 2.0, 3.0, 4.0, 5.0)]
    outs = [
        _outcome(9.0),
        _outcome(0.1, sent=2.0),
        _outcome(0.2, sent=3.0),
        routing.Outcome("shed", 4.0),
        routing.Outcome("failed", 5.0, error="HTTP 500"),
    ]
    samples = [
        routing.Sample(0.5, 0.9, 0.9, 3, 1),
        routing.Sample(2.0, 0.2, 0.5, 2, 4),
        routing.Sample(2.5, 0.4, 0.3, 0, 6),
    ]
    s = routing.summarize(reqs, outs, samples, warmup_s=1.0, ttft_target_s=0.15, ideal=0.6)
    assert (s["requests"], s["completed"], s["shed"], s["failed"]) == (4, 2, 1, 1)
    assert s["ttft_p50_ms"] == pytest.approx(100) and s["ttft_p99_ms"] == pytest.approx(200)
    assert s["window_s"] == pytest.approx(2.0) and s["output_throughput"] == pytest.approx(10.0)
    assert s["goodput"] == pytest.approx(0.5) and s["goodput_share"] == pytest.approx(0.25)
    assert s["hit_rate"] == 0.5 and s["ideal_hit_rate"] == 0.6
    assert s["kv_spread"] == pytest.approx(0.3) and s["kv_usage"] == pytest.approx(0.4) and s["waiting"] == 1
    assert s["preemptions"] == 5 and s["errors"] == ["", "HTTP 500"]
    assert routing.percentile([], 50) != routing.percentile([], 50)  # nan
    assert routing.percentile(list(range(1, 101)), 99) == 99


def test_the_knee_and_the_goals():
    sweep = [{"rate": r, "ttft_p99_ms": p} for r, p in ((1, 1000), (2, 1500), (3, 2500), (4, 9000))]
    assert routing.find_knee(sweep, 2.0) == (3, True)
    assert routing.find_knee(sweep[:2], 2.0) == (2, False)

    def row(kind, load, policy, p99, hit, tput=100.0, shed=0):
        return {
            "workload": kind,
            "load": load,
            "policy": policy,
            "ttft_p99_ms": p99,
            "hit_rate": hit,
            "ideal_hit_rate": 0.9,
            "output_throughput": tput,
            "shed": shed,
        }

    goals = routing.check_goals(
        [
            row("shared", "knee", "kv", 100, 0.85),
            row("shared", "knee", "pow2", 600, 0.25),
            row("unique", "knee", "kv", 104, 0),
            row("unique", "knee", "pow2", 100, 0, 106),
            row("hot", "knee", "kv", 130, 0.5, shed=1),
            row("hot", "knee", "pow2", 100, 0.5, 90),
        ]
    )
    got = {g["goal"]: g["ok"] for g in goals}
    assert got == {
        "shared @ knee: pow2 p99 TTFT / kv's": True,
        "shared @ knee: kv hit rate / pow2's": True,
        "shared @ knee: kv hit rate / ideal": True,
        "shared @ knee: kv throughput / pow2's": True,
        "unique @ knee: kv p99 TTFT / pow2's": True,
        "unique @ knee: kv throughput / pow2's": False,
        "hot @ knee: kv shed - pow2's": False,
        "hot @ knee: kv p99 TTFT / pow2's": False,
        "hot @ knee: kv throughput / pow2's": None,
    }


def test_a_cached_knee_and_whole_policies_are_reused_only_for_the_same_setup(tmp_path):
    key = {"num_workers": 16, "seed": 0}
    knee = {"rate": 2.5, "key": key}

    def row(policy, kind, load):
        return {"policy": policy, "workload": kind, "load": load, "rate": 2.5 if load == "knee" else 1.875}

    rows = [row("kv", k, lb) for k in ("shared", "hot") for lb in ("75% knee", "knee")]
    rows += [row("pow2", "shared", "75% knee"), row("pow2", "shared", "knee"), row("pow2", "hot", "75% knee")]
    path = str(tmp_path / "routing.json")
    routing._write_report(path, {"key": key, "knee": knee, "results": rows})
    report = routing._read_report(path)
    assert routing._cached_knee(report, key)["rate"] == 2.5
    assert routing._cached_knee(report, {**key, "num_workers": 4}) is None
    assert routing._read_report(str(tmp_path / "none.json")) == {}
    # pow2 stopped half way through `hot`: only kv is kept.
    loads = [("75% knee", 1.875), ("knee", 2.5)]
    assert routing._resumable(report, key, loads, ["kv", "pow2"], ["shared", "hot"]) == rows[:4]
    shared = [r for r in rows if r["workload"] == "shared"]
    assert routing._resumable(report, key, loads, ["kv", "pow2"], ["shared"]) == shared
    assert routing._resumable(report, key, [("knee", 3.0)], ["kv"], ["shared", "hot"]) == []
    assert routing._resumable(report, {**key, "seed": 1}, loads, ["kv"], ["shared", "hot"]) == []
    # The key a run makes equals the one its JSON reads back (tuples and all).
    from shoal.cluster.cli import build_parser

    ns = build_parser().parse_args(["bench", "routing", "--sweep-rates", "1,2"])
    made = routing._knee_key(ns, routing.EngineArgs(num_kv_blocks=329), wl.WorkloadSizes())
    assert made == json.loads(json.dumps(made)) and made["sizes"]["system_tokens"] == [1024, 2048]


def test_bad_policies_and_workloads_are_refused(capsys):
    from shoal.cluster.cli import main

    assert main(["bench", "routing", "--policies", "kv,random"]) == 2
    assert "--policies" in capsys.readouterr().err
    assert main(["bench", "routing", "--workloads", "shared,zipf"]) == 2
    assert "--workloads" in capsys.readouterr().err


# ---- end to end (slow tier) ------------------------------------------------------


@pytest.mark.slow
def test_two_policies_on_two_simulated_workers(tmp_path):
    """A Ray cluster, two simulated workers under kv then pow2, `shared` at a
    fixed rate: the table and the JSON hold every figure for both."""
    cost = tmp_path / "cost.json"
    cost.write_text(
        json.dumps(
            {
                "overhead_s": 0.01,
                "prefill_s_per_token": 2e-4,
                "decode_s_per_seq": 1e-3,
                "decode_s_per_context_token": 1e-6,
            }
        )
    )
    out = tmp_path / "routing.json"
    argv = [
        "bench",
        "routing",
        "--num-workers",
        "2",
        "--policies",
        "kv,pow2",
        "--workloads",
        "shared",
        "--rates",
        "2",
        "--duration-s",
        "10",
        "--warmup-s",
        "3",
        "--token-scale",
        "0.25",
        "--open-chats",
        "8",
        "--simulated-cost-model",
        str(cost),
        "--output",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "shoal.cluster.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["num_workers"] == 2 and report["setup"]["working_set_per_worker_cache"] >= 3
    rows = report["results"]
    assert [(r["policy"], r["workload"], r["rate"]) for r in rows] == [("kv", "shared", 2.0), ("pow2", "shared", 2.0)]
    for r in rows:
        assert r["requests"] == rows[0]["requests"] > 5  # the same arrivals for both
        assert r["completed"] + r["shed"] + r["failed"] == r["requests"] and r["completed"] == r["requests"]
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["e2e_p99_ms"]
        assert r["output_throughput"] > 0 and 0 <= r["goodput_share"] <= 1
        assert 0 <= r["hit_rate"] <= 1 and 0 < r["ideal_hit_rate"] <= 1
        assert r["hit_rate"] <= r["ideal_hit_rate"] + 0.1
        assert 0 <= r["kv_spread"] <= 1 and r["kv_samples"] > 5
    assert rows[0]["ideal_hit_rate"] == rows[1]["ideal_hit_rate"]
    assert {g["goal"] for g in report["goals"]} >= {"shared @ 2/s: kv hit rate / pow2's"}
    table = done.stdout[done.stdout.index("TTFT p50") - 200 :]
    for header in ("ok/shed/fail", "TTFT p99", "E2E p99", "out tok/s", "goodput", "hit", "ideal", "KV spread"):
        assert header in table
    assert sum(line.startswith("shared ") for line in table.splitlines()) == 2 and "nan" not in table
    assert (tmp_path / "routing.svg").read_text().count("<polyline") == 1 + 2  # one panel: its axes, a line per policy
