"""The GPU check (scripts/gpu_check.py) on the CPU: the source laid out as
the `shoal` package by links, the stages it plans within its budget, and
the whole check run end to end on tiny shapes with Ray and every other
package the GPU machine lacks hidden from the import system, so that no
module it imports, at import time or later, needs one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check  # noqa: E402

# Project dependencies the device image lacks (it has torch, transformers,
# triton, tokenizers, safetensors, numpy, jinja2, grpcio, protobuf,
# prometheus-client and pytest; no network, no pip).
MISSING_ON_DEVICE = (
    "ray",
    "gguf",
    "llguidance",
    "xgrammar",
    "opentelemetry",
    "starlette",
    "uvicorn",
    "grpc_health",
    "grpc_reflection",
    "openai",
    "flash_attn",
)
# None in sys.modules: `import ray` fails as for a package not installed, and
# importlib.util.find_spec("ray") is None, as transformers' probes expect.
HIDER = f"""
import sys

for name in {MISSING_ON_DEVICE!r}:
    sys.modules[name] = None
"""
TINY_BENCH = (
    "--device cpu --num-threads 1 --no-cpu-kernels --batch-sizes 1 --decode-steps 2 --prompt-len 16 "
    "--num-prompts 2 --input-len 16 64 --output-len 8 8 --check-prompts 2 --check-tokens 4 --kv-offload-lens 32,64"
)


def test_layout_puts_the_source_under_shoal(tmp_path):
    path = gpu_check.layout(ROOT, str(tmp_path))
    code = "import shoal.workers, shoal.benchmarks.gpu as g; print(shoal.workers.__file__); print(g.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert files == [
        os.path.join(path, "shoal", "workers", "__init__.py"),
        os.path.join(path, "shoal", "benchmarks", "gpu.py"),
    ]
    for folder in gpu_check.FOLDERS:
        assert os.path.realpath(os.path.join(path, "shoal", folder)) == os.path.join(ROOT, folder)


def test_the_stages_fit_the_budget_and_measure_fp8_beside_bfloat16(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["tests", "tokens", *gpu_check.SHAPES, "kv-offload"]
    assert "-m gpu" in lines[0] and "test_fp8_quantization.py" in lines[0] and "test_cuda_graph.py" in lines[0]
    assert "--skip decode,offline,kv_offload" in lines[1]  # the token check alone, on its own model
    for line in lines[2:-1]:
        assert "--quantization fp8" in line and "--skip tokens,kv_offload" in line
    assert "--skip tokens,offline" in lines[-1] and f"--shapes {gpu_check.SHAPES[0]}" in lines[-1]
    # under 8 minutes in all, so that a second try fits the 15-minute lease
    assert sum(gpu_check.LIMITS.values()) <= 480 and gpu_check.BUDGET <= 480


def test_every_gpu_test_file_is_in_the_check():
    files = {os.path.basename(f) for f in gpu_check.gpu_test_files(os.path.join(ROOT, "tests"))}
    assert {"test_cuda_graph.py", "test_fp8_quantization.py", "test_sampling_noise.py"} <= files
    assert "test_gpu_check.py" not in files


def test_the_check_runs_on_the_cpu_without_what_the_device_lacks(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDER)
    out = tmp_path / "out"
    argv = [sys.executable, SCRIPT, "--out", str(out), "--shapes", "tiny", "--tokens-model", "tiny"]
    argv += ["--bench-args", TINY_BENCH, "--budget", "3000", "--limit-scale", "10"]
    done = subprocess.run(
        argv, env={**os.environ, "PYTHONPATH": str(hide)}, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    check = json.loads((out / "check.json").read_text())
    assert {k: v["result"] for k, v in check["stages"].items()} == {
        "tests": "passed",
        "tokens": "passed",
        "tiny": "passed",
        "kv-offload": "passed",
    }
    tests = json.loads((out / "tests.json").read_text())["junit"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # no CUDA here: every gpu test skips
    tokens = json.loads((out / "tokens.json").read_text())["tokens"]
    assert set(tokens) == {"plain", "chunked prefill", "preempting"}
    assert all(r["ok"] and r["equal"] == r["prompts"] == 2 for r in tokens.values())
    tiny = json.loads((out / "tiny.json").read_text())["shapes"]["tiny"]
    assert tiny["fp8_vs_float32"]["decode batch 1"] > 0
    assert tiny["offline"]["shoal"]["output_tok_s"] > 0
    offload = json.loads((out / "kv-offload.json").read_text())["shapes"]["tiny"]["kv_offload"]
    assert set(offload["ttft"]) == {"32", "64"} and all(r["host_hit_tokens"] > 0 for r in offload["ttft"].values())
    assert offload["decode"]["1"]["x_off"] > 0  # beside the same run's decode with the tier off
    files = ["check.json", "kv-offload.json", "tests.json", "tests.xml", "tiny.json", "tokens.json"]
    assert sorted(os.listdir(out)) == files


@pytest.mark.parametrize("module", ["ray", "gguf", "opentelemetry.trace", "llguidance"])
def test_the_hider_hides(tmp_path, module):
    """The check above means something only if the hidden packages cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(HIDER)
    code = f"import importlib.util; assert importlib.util.find_spec({module.split('.')[0]!r}) is None; import {module}"
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True
    )
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, done.stderr
