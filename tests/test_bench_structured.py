"""`shoal bench structured --quick` end to end on the tiny model: a row per
schema, batch and library, whose figures agree with one another; and the
pieces it stands on (matched steps, the JSON check) on their own."""

from __future__ import annotations

import importlib.util
import json

from shoal.benchmarks.structured import lockstep, palindrome, validate
from shoal.benchmarks.structured_workloads import WORKLOADS, record_schema, tool_call_schema
from shoal.cluster.cli import main
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.workers import LLMEngine, SamplingParams


def test_bench_structured_quick_reports_every_row(tiny_model, tmp_path, capsys):
    out = tmp_path / "structured.json"
    args = ["bench", "structured", "--quick", "--model", tiny_model, "--num-threads", "1", "--num-kv-blocks", "128"]
    assert main([*args, "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    backends = ["guidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])
    keys = [(s["workload"], s["batch"], s["backend"]) for s in r["steps"]]
    assert keys == [(w.name, b, lib) for w in WORKLOADS for b in (4, 1) for lib in backends]
    for s in r["steps"]:
        # max_tokens 24: at most 23 decode steps after the first token, in each run (batch 1 runs twice, palindrome)
        runs = 2 if s["batch"] == 1 else 1
        assert 0 < s["steps"] <= 23 * runs and s["replies"] == s["batch"] * runs
        assert abs(s["raw_ratio"] - s["guided_ms"] / s["unconstrained_ms"]) < 1e-9
        assert abs(s["ratio"] - s["raw_ratio"] / s["engine_speed"]) < 1e-9
        assert s["engine_speed"] == r["engine_speeds"][str(s["batch"])][s["backend"]] > 0
        assert s["batch"] > 1 or s["engine_speed"] == 1.0  # batch 1: one engine for all
        # The host ratio swaps the guided forward for the unconstrained one: it differs by exactly that.
        host_ms = s["guided_ms"] + s["forward_ms"]["unconstrained"] - s["forward_ms"]["guided"]
        assert abs(s["host_ratio"] - host_ms / s["unconstrained_ms"]) < 1e-9
        assert s["goal"] == (1.05 if s["batch"] == 1 else 1.10)
        assert s["extra_ms"]["grammar_bitmask"] > 0  # the mask fill is the guided run's alone
        assert 0 <= s["valid"] <= s["replies"] and set(s["finish_reasons"]) <= {"stop", "length"}
    assert [(c["workload"], c["backend"]) for c in r["compile"]] == [
        (w.name, lib) for w in WORKLOADS for lib in backends
    ]
    for c in r["compile"]:
        assert c["schemas"] == 4 and 0 < c["compile_ms"]["p50"] <= c["compile_ms"]["p99"]
        assert c["cache_hit_ms"]["p50"] < c["compile_ms"]["p50"]  # a hit skips the compile
    printed = capsys.readouterr().out
    assert "| tool call | 4 | guidance |" in printed and "compile p50" in printed


def test_lockstep_runs_match_step_for_step(tiny_model):
    """Unconstrained and guided on two engines (libraries), a step of each
    in turn: every full-batch decode step of a guided batch has its
    unconstrained twin, and the unconstrained batch stops when no guided
    one is whole (its requests aborted, its engine left empty)."""
    make = lambda **kw: LLMEngine(model=tiny_model, num_threads=1, num_kv_blocks=64, **kw)  # noqa: E731
    free_engine, engines = make(), {"guidance": make()}
    if importlib.util.find_spec("xgrammar"):
        engines["xgrammar"] = make(structured_outputs_backend="xgrammar")
    try:
        prompts = ["The quick brown fox", "Hello, world!", "Numbers: 0 1 2"]
        free, guided = lockstep(
            free_engine,
            engines,
            prompts,
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex="[a-z]{16}")),
            "t",
        )
        assert not free_engine.has_unfinished_requests() and set(guided) == set(engines)
        for w in guided.values():
            assert w.done and set(w.finish.values()) == {"stop"}
            assert all(len(w.text[i]) == 16 and w.text[i].isalpha() for i in w.ids)
            assert w.steps and set(w.steps) <= set(free.steps)
        assert max(free.steps) == max(len(w.steps) for w in guided.values())  # no further than needed
        assert len(free.steps) < 39  # stopped before its max_tokens
    finally:
        for e in (free_engine, *engines.values()):
            e.shutdown()


def test_palindrome_runs_every_library_on_one_engine(tiny_model):
    """Batch 1: each library, the unconstrained run twice, each library again
    (reversed), all on one engine; an unconstrained run stops at the longest
    guided run's last matched step; the engine keeps its own manager after."""
    names = ["guidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])
    engines = {
        n: LLMEngine(model=tiny_model, num_threads=1, num_kv_blocks=64, structured_outputs_backend=n) for n in names
    }
    engine = LLMEngine(model=tiny_model, num_threads=1, num_kv_blocks=64)
    own = engine.structured_output
    try:
        runs = palindrome(
            engine,
            engines,
            ["Hello, world!"],
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex="[a-z]{12}")),
            "p",
        )
        assert engine.structured_output is own and not engine.has_unfinished_requests()
        assert set(runs) == {"free", *names} and all(len(w) == 2 for w in runs.values())
        need = max(len(w.steps) for n in names for w in runs[n])
        assert [len(w.steps) for w in runs["free"]] == [need, need] and need < 39
        for n in names:
            assert all(w.engine is engine and len(w.text[w.ids[0]]) == 12 for w in runs[n])
            assert list(runs[n][0].text.values()) == list(runs[n][1].text.values())  # greedy: the same reply twice
    finally:
        for e in (engine, *engines.values()):
            e.shutdown()


def test_the_json_check_and_the_schemas():
    schema = tool_call_schema()
    good = json.dumps({"location": "Paris", "unit": "celsius", "days": 3, "include_hourly": False})
    assert validate([good, good[:-1], good.replace("3", "30"), '{"location": "a\x01"}'], schema) == 1
    for tag in ("", "_7"):  # each tag renames a property: a new schema, a new cache key
        assert len(record_schema(tag)["properties"]) == 30
        assert SO(json=record_schema(tag)).spec != SO(json=record_schema("_x")).spec
