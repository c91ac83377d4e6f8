"""`shoal bench gpu` end to end on the CPU, on the tiny shape, and without Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

NO_RAY = "\nassert 'ray' not in sys.modules, 'ray was imported'"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_command_imports_no_ray():
    code = "\n".join(
        [
            "import sys",
            "from shoal.cluster.cli import build_parser",
            "try:",
            "    build_parser().parse_args(['bench', 'gpu', '--help'])",
            "except SystemExit:",
            "    pass",
        ]
    )
    done = _python(code + NO_RAY)
    assert done.returncode == 0, done.stderr
    assert "--shapes" in done.stdout and "--skip" in done.stdout


@pytest.fixture(scope="module")
def tiny_run(tiny_model, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench-gpu") / "gpu.json"
    argv = [
        "bench",
        "gpu",
        "--device",
        "cpu",
        "--shapes",
        "tiny",
        "--model",
        tiny_model,
        "--output",
        str(out),
        "--batch-sizes",
        "1,4",
        "--decode-steps",
        "4",
        "--prompt-len",
        "64",
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "64",
        "--output-len",
        "8",
        "16",
        "--check-prompts",
        "4",
        "--check-tokens",
        "8",
        "--num-threads",
        "1",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--kv-offload-lens",
        "32,64",
    ]
    code = f"import sys\nfrom shoal.cluster.cli import main\nrc = main({argv!r})"
    done = _python(code + NO_RAY + "\nsys.exit(rc)")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_tokens_are_checked_in_three_regimes(tiny_run):
    report, _ = tiny_run
    tokens = report["tokens"]
    assert list(tokens) == ["plain", "chunked prefill", "preempting"]
    assert all(r["prompts"] == 4 and r["ok"] for r in tokens.values()), tokens
    assert tokens["preempting"]["preemptions"] > 0
    assert report["ok"]


def test_decode_and_offline_are_timed_against_their_baselines(tiny_run):
    report, stdout = tiny_run
    assert report["copy_bytes_per_s"] > 0
    tiny = report["shapes"]["tiny"]
    decode = tiny["decode"]
    assert decode["weight_bytes"] > 0 and decode["floor_ms"] > 0
    assert list(decode["batches"]) == ["1", "4"]
    assert all(b["ms"] > 0 and b["x_floor"] > 0 for b in decode["batches"].values())
    offline = tiny["offline"]
    assert offline["requests"] == 2
    assert offline["shoal"]["output_tok_s"] > 0 and offline["transformers_cb"]["output_tok_s"] > 0
    assert offline["shoal_vs_cb"] > 0
    assert decode["start"]["kv_blocks"] > 0 and decode["start"]["cuda_graphs"] is None  # no CUDA here
    # one table at the end, a row per result, none an error
    table = stdout[stdout.index("\npart ") :]
    assert len(report["rows"]) == 3 + 1 + 2 + 1 + 3 and "error" not in table


def test_host_tier_hits_are_timed_against_computed_and_decode_beside_tier_off(tiny_run):
    report, _ = tiny_run
    offload = report["shapes"]["tiny"]["kv_offload"]
    for n, r in offload["ttft"].items():  # every block but the last token's, from the host tier
        assert r["host_hit_tokens"] == (int(n) - 1) // 16 * 16 and r["computed_ms"] > 0 and r["loaded_ms"] > 0
    # the batches the paged cache (sized to the longest prompt) holds, beside the decode part's
    assert list(offload["decode"]) == ["1"]
    assert offload["decode"]["1"]["off_ms"] == report["shapes"]["tiny"]["decode"]["batches"]["1"]["ms"]


@pytest.mark.parametrize(
    "flags, why", [(["--skip", "tokens,warmup"], "--skip takes"), (["--shapes", "tiny,llama-9b"], "unknown shape")]
)
def test_bad_parts_and_shapes_are_refused_before_anything_runs(flags, why, capsys):
    from shoal.cluster.cli import main

    assert main(["bench", "gpu", "--device", "cpu", *flags]) == 2
    assert why in capsys.readouterr().err


def test_a_changed_token_is_found_with_the_reference_gap(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    from shoal.benchmarks.tp import first_difference, hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8]
    (ref,) = hf_greedy(hf, [prompt], 6)
    assert len(ref) == 6 and first_difference(hf, prompt, ref, ref) is None
    ours = ref[:3] + [(ref[3] + 1) % 512] + ref[4:]
    i, gap = first_difference(hf, prompt, ours, ref)
    assert i == 3 and gap > 0


def test_quantization_reaches_the_engine_args_and_runs_beside_the_unquantized_dtype():
    from shoal.benchmarks.gpu import modes, unquantized
    from shoal.cluster.cli import build_parser
    from shoal.workers.engine_args import EngineArgs

    ns = build_parser().parse_args(["bench", "gpu", "--device", "cpu", "--quantization", "fp8"])
    args = EngineArgs.from_cli_args(ns)
    assert args.quantization == "fp8"
    (plain_label, plain), (label, quant) = modes(args, "bfloat16")
    assert (plain_label, plain.quantization) == ("bfloat16", "none") and (label, quant) == ("fp8", args)
    assert unquantized(args).quantization == "none"  # the token check's engine
    none = EngineArgs.from_cli_args(build_parser().parse_args(["bench", "gpu"]))
    assert modes(none, "bfloat16") == [("", none)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "gpu", "--quantization", "int3"])


def test_fp8_decode_is_timed_beside_float_with_its_speedup(tiny_model, tmp_path, capsys):
    from shoal.cluster.cli import main

    out = tmp_path / "gpu.json"
    argv = ["bench", "gpu", "--device", "cpu", "--shapes", "tiny", "--quantization", "fp8", "--skip", "tokens,offline"]
    argv += ["--output", str(out), "--batch-sizes", "1", "--decode-steps", "2", "--prompt-len", "16"]
    argv += ["--num-threads", "1", "--kv-cache-memory-bytes", str(16 << 20), "--no-cpu-kernels"]
    assert main(argv) == 0, capsys.readouterr().out[-3000:]
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    assert tiny["decode"]["weight_bytes"] > tiny["decode_fp8"]["weight_bytes"]  # fp8 weights: 1 byte each
    assert tiny["decode_fp8"]["batches"]["1"]["ms"] > 0
    assert tiny["fp8_vs_float32"]["decode batch 1"] > 0
    assert "fp8 vs float32: decode batch 1 " in capsys.readouterr().out
