"""`shoal bench offline`'s workload presets (pure functions), its peer's
settings against them, its flags, and one small run end to end on the tiny
model against transformers' continuous batching; `bench tune-cb`, which
times that peer under other settings, likewise."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from shoal.benchmarks import offline, roofline, tune_cb
from shoal.benchmarks.offline_workloads import PRESETS, make_workload
from shoal.cluster.cli import main
from shoal.proto.utils import cdiv

# name: requests, prompt lengths (after the shared prefix), output lengths, shared prefix: the brief's numbers
STATED = {
    "default": (64, (32, 512), (32, 256), 0),
    "short": (256, (16, 128), (16, 64), 0),
    "long": (16, (1024, 2048), (128, 512), 0),
    "chat": (64, (16, 128), (32, 256), 300),
}
VOCAB = 49152


@pytest.mark.parametrize("name", STATED)
def test_each_preset_makes_its_stated_counts_and_lengths(name):
    w = PRESETS[name]
    n, (lo, hi), (out_lo, out_hi), prefix = STATED[name]
    assert (w.num_prompts, w.input_len, w.output_len, w.shared_prefix) == STATED[name]
    work = make_workload(w.num_prompts, 0, w.input_len, w.output_len, VOCAB, w.shared_prefix)
    assert len(work) == n
    assert all(prefix + lo <= len(p) <= prefix + hi and out_lo <= m <= out_hi for p, m in work)
    assert all(0 <= t < VOCAB for p, _ in work for t in p)
    # the ranges are drawn across, not pinned at one end
    assert len({len(p) for p, _ in work}) > 1 and len({m for _, m in work}) > 1


def test_chat_prompts_share_one_300_token_system_prompt():
    w = PRESETS["chat"]
    work = make_workload(w.num_prompts, 0, w.input_len, w.output_len, VOCAB, w.shared_prefix)
    assert len({tuple(p[:300]) for p, _ in work}) == 1
    assert len({tuple(p[300:]) for p, _ in work}) == len(work)  # each user part its own
    other = make_workload(w.num_prompts, 1, w.input_len, w.output_len, VOCAB, w.shared_prefix)
    assert other[0][0][:300] != work[0][0][:300]  # the seed draws the system prompt too


def test_default_is_the_workload_it_was_seed_for_seed():
    def before(n, seed, input_len, output_len, vocab):  # make_workload as it was before the presets
        rng = random.Random(seed)
        work = []
        for _ in range(n):
            plen = rng.randint(*input_len)
            work.append(([rng.randrange(vocab) for _ in range(plen)], rng.randint(*output_len)))
        return work

    w = PRESETS["default"]
    for seed in (0, 7):
        assert make_workload(w.num_prompts, seed, w.input_len, w.output_len, VOCAB) == before(
            w.num_prompts, seed, w.input_len, w.output_len, VOCAB
        )


@pytest.mark.parametrize("name", STATED)
def test_the_peers_settings_fit_their_workload(name):
    """The reasoning of CB_SETTINGS, held: the cache holds a step's requests at their longest (none is
    evicted), a whole prompt fits one step, and chat's pages tile its system prompt (all of it shared)."""
    w, s = PRESETS[name], offline.CB_SETTINGS[name]
    longest = w.shared_prefix + w.input_len[1] + w.output_len[1]
    pages = cdiv(longest, s.page_size)
    assert s.max_requests_per_batch * pages <= s.num_blocks
    assert w.shared_prefix + w.input_len[1] <= s.max_batch_tokens
    assert w.shared_prefix % s.page_size == 0
    assert s.scheduler_type in ("fifo", "prefill_first") and s.allow_block_sharing


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--workload", "short", "--input-len", "8", "16"], "shape the default workload only"),
        (["--workload", "all", "--output-len", "8", "16"], "shape the default workload only"),
        (["--workload", "tiny"], "--workload takes"),
        (["--peers", "cb,sglang"], "--peers takes"),
        (["--peers", "vllm", "--vllm-dtype", "float16"], "--vllm-dtype takes"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(flags, why, capsys):
    assert main(["bench", "offline", *flags]) == 2
    assert why in capsys.readouterr().err


def fake_gemms(threads, int8):
    return {"float32": {"ops_s": 1e11, "wall_ops_s": 1e11, "by": roofline.MKL_F32}}


def fake_rooflines(threads, achieved):
    """measure_rooflines as on an AVX2 machine, without timing anything."""
    roofs = {a: {"threads": threads, "paths": {}} for a in roofline.ARITHMETICS}
    roofs["float32"]["paths"]["avx2-fma"] = {"ops_s": 2e11, "wall_ops_s": 2e11, "instruction": "vfmadd231ps ymm"}
    roofs["int8"]["paths"]["avx2-maddubs"] = {"ops_s": 4e11, "wall_ops_s": 4e11, "instruction": "vpmaddubsw"}
    roofs["bfloat16"]["paths"]["avx512bf16-dpbf16"] = {"absent": "no AVX512-BF16"}
    for arith, got in achieved.items():
        roofs[arith]["achieved"] = got
    for entry in roofs.values():
        roofline._settle(entry)
    return roofs


def test_two_workloads_run_against_continuous_batching_with_its_settings_stated(
    tiny_model, tmp_path, capsys, monkeypatch
):
    # The 2 s matmul measurement and the peaks' are not what this checks; the machine may be busy.
    monkeypatch.setattr(offline, "measure_gemms", fake_gemms)
    monkeypatch.setattr(offline, "measure_rooflines", fake_rooflines)
    out = tmp_path / "offline.json"
    assert (
        main(
            [
                "bench",
                "offline",
                "--model",
                tiny_model,
                "--workload",
                "short,chat",
                "--num-prompts",
                "4",
                "--peers",
                "cb",
                "--num-threads",
                "1",
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["matmul_flops"] == 1e11 and list(report["workloads"]) == ["short", "chat"]
    assert report["rooflines"]["float32"]["achieved"] == fake_gemms(1, False)["float32"]
    printed = capsys.readouterr().out
    assert "vfmadd231ps ymm (avx2-fma)" in printed and "% of its arithmetic's roofline" in printed
    for name, rep in report["workloads"].items():
        w = rep["workload"]
        assert w["name"] == name and w["num_prompts"] == 4 and w["seed"] == 0
        assert w["shared_prefix"] == STATED[name][3]
        assert list(rep["results"]) == ["shoal", offline.CB]  # --peers cb: no generate
        shoal, cb = rep["results"]["shoal"], rep["results"][offline.CB]
        assert shoal["seconds"] > 0 and cb["seconds"] > 0 and shoal["output_tok_s"] > 0
        assert rep["shoal_vs_cb"] == cb["seconds"] / shoal["seconds"]
        # the tiny model runs in float32: each run's share is of the float32 peak
        for r in (shoal, cb):
            assert r["roofline"]["arithmetic"] == r["roofline"]["against"] == "float32"
            assert (
                0
                < r["roofline_fraction"]
                == r["roofline"]["fraction"]
                == 2 * rep["params"] * (w["prompt_tokens"] + w["output_tokens"]) / r["seconds"] / 2e11
            )
        # the settings transformers ran with, read back from it: the table's, on sdpa
        assert cb["settings"] == dataclasses.asdict(offline.CB_SETTINGS[name]) | {"attn_implementation": "sdpa"}
        assert offline.describe_cb(cb["settings"]) in printed
    summary = printed[printed.index("transformers CB settings") :]
    assert "short" in summary and "chat" in summary


def test_tune_cb_varies_one_field_at_a_time_around_the_preset():
    w = PRESETS["short"]
    base = offline.CB_SETTINGS["short"]
    tries = tune_cb.variants(
        w, ["max_requests_per_batch=8,128", "scheduler_type=prefill_first", f"page_size={base.page_size}"]
    )
    assert tries[0] == base and len(tries) == 4  # the preset's own page size is not run twice
    fewer, more, sched = tries[1:]
    assert fewer == dataclasses.replace(base, max_requests_per_batch=8)  # the preset's cache already holds 8
    # 128 requests at 192 tokens: 3 pages each, and a quarter to spare
    assert more == dataclasses.replace(base, max_requests_per_batch=128, num_blocks=480)
    assert sched == dataclasses.replace(base, scheduler_type="prefill_first")
    for s in tries:  # none evicts: the presets' own rule
        assert s.num_blocks >= s.max_requests_per_batch * cdiv(w.input_len[1] + w.output_len[1], s.page_size)


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--vary", "max_requests_per_batch"], "--vary takes FIELD=V1,V2"),
        (["--vary", "attn_implementation=eager"], "--vary takes FIELD=V1,V2"),
        (["--vary", "page_size=0"], "positive integers"),
        (["--vary", "scheduler_type=lifo"], "scheduler_type takes"),
        (["--workload", "all"], "--workload takes one of"),
    ],
)
def test_tune_cb_refuses_bad_flags_before_anything_loads(flags, why, capsys):
    assert main(["bench", "tune-cb", *flags]) == 2
    assert why in capsys.readouterr().err


def test_tune_cb_runs_each_setting_and_reports_what_transformers_ran(tiny_model, tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert (
        main(
            [
                "bench",
                "tune-cb",
                "--model",
                tiny_model,
                "--workload",
                "short",
                "--num-prompts",
                "3",
                "--vary",
                "max_requests_per_batch=2",
                "--num-threads",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["workload"]["name"] == "short" and report["workload"]["num_prompts"] == 3
    want = tune_cb.variants(PRESETS["short"], ["max_requests_per_batch=2"])
    assert [r["settings"] for r in report["results"]] == [
        dataclasses.asdict(s) | {"attn_implementation": "sdpa"} for s in want
    ]
    assert all(r["seconds"] > 0 for r in report["results"])
    ranked = capsys.readouterr().out.split("(ranked)")[1]
    assert all(offline.describe_cb(r["settings"]) in ranked for r in report["results"])


def test_a_run_is_labelled_with_the_quantization_its_layers_were_built_with(tiny_model):
    from shoal.benchmarks.offline import served_quantization
    from shoal.workers import LLM

    for method in ("none", "int8"):
        with LLM(tiny_model, quantization=method, num_threads=1, num_kv_blocks=16) as llm:
            assert served_quantization(llm.engine.model_executor.driver_worker.runner.model) == method
