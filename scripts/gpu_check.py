"""The GPU check: one command for a session that holds a device.

    OUT=/some/dir python3 scripts/gpu_check.py       # on the GPU machine, from the repository root
    python3 scripts/gpu_check.py --dry-run           # anywhere: the stages it would run

It runs on the device image as it is (torch, transformers, triton; no Ray,
no flash-attn, no network, no pip, no install of this project): the source
is laid out as the `shoal` package under a temporary folder by symbolic
links (workers, router, cluster, proto, benchmarks -> shoal/<folder>) and
put on PYTHONPATH with tests/. Then, each stage a child process with its
own time limit inside one budget of --budget seconds (default 7.5 min,
under the 8 the GPU-run issue allows, so a second try fits a 15-minute
lease):

1. tests: pytest -m gpu over the test files that hold such tests (or, where
   pytest is absent, says so and runs their test functions as plain Python);
2. tokens: `shoal bench gpu` part one, greedy tokens in float32 against
   transformers on a random model of SmolLM2-135M's shape made on the spot
   (the default model's file is not on the device);
3. one stage per --shapes shape: decode ms/step against the bandwidth floor
   and offline against transformers' continuous batching, with dummy
   weights, in bfloat16 and with --quantization fp8 beside it;
4. kv-offload, on the first shape: TTFT of 1k, 4k and 16k-token prompts
   loaded from the host KV tier against computed, and decode with the
   tier on against off (the least important stage: last, so that it is
   the one a short budget drops).

Each stage writes JSON under $OUT (tests.json, tokens.json, <shape>.json, kv-offload.json)
as soon as it ends, and check.json sums them up, so a stage cut off by its
limit loses only itself. The exit code is 0 when every stage ran and passed.
No module these stages import imports Ray (tests/test_gpu_check.py checks
that on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("workers", "router", "cluster", "proto", "benchmarks")
SHAPES = ("smollm2-1.7b", "llama-3.1-8b")
# Seconds each stage may take at most, within the budget (the rest of it, when less is left).
LIMITS = {"tests": 80, "tokens": 70, "smollm2-1.7b": 120, "llama-3.1-8b": 140, "kv-offload": 70}
BUDGET = 450.0  # all stages together: under the 8 minutes that leave a second try room in the lease
# The token check's random model: SmolLM2-135M's shape (tests/tiny_models.py's tokenizer and initialisation).
TOKENS_MODEL = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
)


def layout(root: str, dest: str) -> str:
    """dest/shoal/<folder> -> root/<folder> for each of FOLDERS; returns the
    PYTHONPATH entry (dest) under which `import shoal.workers` finds the source."""
    pkg = os.path.join(dest, "shoal")
    os.makedirs(pkg, exist_ok=True)
    for folder in FOLDERS:
        os.symlink(os.path.join(root, folder), os.path.join(pkg, folder))
    return dest


def gpu_test_files(tests_dir: str) -> list[str]:
    """The test files that hold a test marked gpu."""
    out = []
    for name in sorted(os.listdir(tests_dir)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests_dir, name)) as f:
                text = f.read()
            if "pytest.mark.gpu" in text:
                out.append(os.path.join(tests_dir, name))
    return out


def stages(
    out: str,
    work: str,
    shapes: list[str],
    python: str = sys.executable,
    have_pytest: bool = True,
    bench_args: tuple[str, ...] = (),
    tokens_model: str = "smollm2-135m",
) -> list[dict]:
    """The stages in order: {name, argv, json (what it writes under out),
    limit, before (a set-up command, or absent)}; work: a scratch folder;
    bench_args: appended to every `bench gpu`."""
    tests = gpu_test_files(os.path.join(ROOT, "tests"))
    if have_pytest:
        run_tests = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-o", "addopts="]
        run_tests += ["--junitxml", os.path.join(out, "tests.xml"), *tests]
    else:
        run_tests = [python, os.path.abspath(__file__), "--plain-tests", *tests]
    bench = [python, "-m", "shoal.cluster.cli", "bench", "gpu", *bench_args]
    model = os.path.join(work, "tokens-model")
    made = [python, os.path.abspath(__file__), "--make-tokens-model", model, "--tokens-model", tokens_model]
    out_stages = [
        dict(name="tests", argv=run_tests, json="tests.json", limit=LIMITS["tests"]),
        dict(
            name="tokens",
            argv=[
                *bench,
                "--model",
                model,
                "--skip",
                "decode,offline,kv_offload",
                "--output",
                os.path.join(out, "tokens.json"),
            ],
            before=made,
            json="tokens.json",
            limit=LIMITS["tokens"],
        ),
    ]
    for shape in shapes:
        argv = [*bench, "--shapes", shape, "--skip", "tokens,kv_offload", "--quantization", "fp8"]
        argv += ["--output", os.path.join(out, f"{shape}.json")]
        out_stages.append(dict(name=shape, argv=argv, json=f"{shape}.json", limit=LIMITS.get(shape, 150)))
    if shapes:
        argv = [*bench, "--shapes", shapes[0], "--skip", "tokens,offline", "--batch-sizes", "1,32"]
        argv += ["--output", os.path.join(out, "kv-offload.json")]
        out_stages.append(dict(name="kv-offload", argv=argv, json="kv-offload.json", limit=LIMITS["kv-offload"]))
    return out_stages


def make_tokens_model(path: str, shape: str) -> None:
    """The token check's random model (transformers and tokenizers only):
    SmolLM2-135M's shape, or tiny_models.py's own (the CPU test's)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_models import make_tiny_model

    make_tiny_model(path, **(TOKENS_MODEL if shape == "smollm2-135m" else {}))


def plain_tests(files: list[str]) -> int:
    """Without pytest: each file's gpu-marked test functions that take no
    arguments, called in turn (parametrized ones are reported as not run)."""
    import importlib.util
    import traceback

    failed = 0
    for path in files:
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:
            print(f"{path}: cannot be imported without pytest")
            traceback.print_exc()
            failed += 1
            continue
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("test_") and callable(fn):
                if getattr(fn, "__code__", None) is None or fn.__code__.co_argcount:
                    print(f"{name}: takes arguments, not run without pytest")
                    continue
                try:
                    fn()
                    print(f"{name}: passed")
                except Exception:
                    failed += 1
                    print(f"{name}: FAILED")
                    traceback.print_exc()
    return 1 if failed else 0


def _junit_summary(path: str) -> dict:
    """pytest's counts from its junit file."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        head = f.read(4000)
    m = re.search(r"<testsuite [^>]*", head)
    if m is None:
        return {}
    return {k: int(v) for k, v in re.findall(r'(errors|failures|skipped|tests)="(\d+)"', m.group(0))}


def run(out: str, shapes: list[str], budget: float, limit_scale: float = 1.0, **stage_args) -> int:
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="shoal-gpu-check-")
    env = dict(os.environ)
    path = [layout(ROOT, tmp), os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    # The Triton test files set TRITON_INTERPRET=1 as they are imported unless this says
    # otherwise: one such import would leave the whole pytest process interpreting.
    env["SHOAL_TRITON_COMPILED"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    have_pytest = subprocess.run([sys.executable, "-c", "import pytest"], env=env, capture_output=True).returncode == 0
    if not have_pytest:
        print("pytest is absent here: the gpu tests run as plain Python functions")
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": budget, "stages": {}}
    t0 = time.monotonic()
    ok = True
    try:
        for stage in stages(out, tmp, shapes, have_pytest=have_pytest, **stage_args):
            left = budget - (time.monotonic() - t0)
            limit = min(stage["limit"] * limit_scale, left)
            rec: dict = {"argv": stage["argv"][1:], "limit_s": round(limit)}
            if limit < 20:
                rec["result"] = "not run: the budget is spent"
                ok = False
            else:
                print(f"\n== {stage['name']} (at most {limit:.0f} s)", flush=True)
                start = time.monotonic()
                try:
                    if stage.get("before"):
                        subprocess.run(stage["before"], env=env, check=True, timeout=limit)
                    rc = subprocess.run(stage["argv"], env=env, timeout=max(1.0, limit - (time.monotonic() - start)))
                    rec["rc"] = rc.returncode
                    rec["result"] = "passed" if rc.returncode == 0 else "failed"
                except subprocess.TimeoutExpired:
                    rec["result"] = "cut off at its limit"
                except subprocess.CalledProcessError as e:
                    rec["result"] = f"its set-up failed (rc {e.returncode})"
                rec["seconds"] = round(time.monotonic() - start, 1)
                ok = ok and rec["result"] == "passed"
            if stage["name"] == "tests":
                rec["junit"] = _junit_summary(os.path.join(out, "tests.xml"))
                with open(os.path.join(out, "tests.json"), "w") as f:
                    json.dump(rec, f, indent=2)
            summary["stages"][stage["name"]] = rec
            summary["seconds"] = round(time.monotonic() - t0, 1)
            with open(os.path.join(out, "check.json"), "w") as f:
                json.dump(summary, f, indent=2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary["stages"], indent=1))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench_results", "gpu_check"))
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of benchmarks/gpu_shapes.py shapes")
    p.add_argument("--budget", type=float, default=BUDGET, help="seconds for all stages together")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiplies each stage's own limit")
    p.add_argument("--dry-run", action="store_true", help="print the stages and exit")
    p.add_argument("--bench-args", default="", help="more flags for every `shoal bench gpu` (one quoted string)")
    p.add_argument("--tokens-model", choices=("smollm2-135m", "tiny"), default="smollm2-135m")
    p.add_argument("--make-tokens-model", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--plain-tests", nargs="+", metavar="FILE", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.make_tokens_model:
        make_tokens_model(ns.make_tokens_model, ns.tokens_model)
        return 0
    if ns.plain_tests:
        return plain_tests(ns.plain_tests)
    shapes = [s for s in ns.shapes.split(",") if s]
    extra = dict(bench_args=tuple(shlex.split(ns.bench_args)), tokens_model=ns.tokens_model)
    if ns.dry_run:
        for stage in stages(ns.out, "<scratch>", shapes, **extra):
            print(f"{stage['name']} ({stage['limit']} s): {shlex.join(stage['argv'])}")
        return 0
    return run(ns.out, shapes, ns.budget, ns.limit_scale, **extra)


if __name__ == "__main__":
    sys.exit(main())
