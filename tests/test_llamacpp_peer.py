"""llama.cpp as `shoal bench latency`'s peer (benchmarks/llamacpp_peer.py):
without llama-cpp-python the bench says so and carries on; with it (slow),
the peer's greedy tokens are the ones pinned in tests/data by
scripts/pin_llamacpp_reference.py."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

from shoal.benchmarks import llamacpp_peer
from shoal.cluster.cli import main

PINNED = os.path.join(os.path.dirname(__file__), "data", "llamacpp_smollm2_q4_1.json")


@pytest.fixture
def no_llama_cpp(monkeypatch):
    # None in sys.modules makes `import llama_cpp` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


def _bench(model: str, out, *extra: str) -> int:
    argv = ["bench", "latency", "--model", model, "--input-len", "8", "--output-len", "3"]
    argv += ["--num-iters", "1", "--num-iters-warmup", "0", "--read-mib", "4", "--output", str(out), *extra]
    return main(argv)


def test_bench_latency_carries_on_without_llama_cpp(no_llama_cpp, tiny_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert _bench(tiny_model, out) == 0
    printed = capsys.readouterr().out
    assert llamacpp_peer.NOT_INSTALLED in printed
    # shoal's own figures are all there; no peer figures
    assert "time per output token" in printed and "per-token time / floor" in printed
    r = json.loads(out.read_text())
    assert r["tpot_ms"]["p50"] > 0 and "peers" not in r


def test_peer_without_llama_cpp_returns_none(no_llama_cpp, capsys):
    assert llamacpp_peer.import_llama_cpp() is None
    assert llamacpp_peer.run_latency("model.gguf", [[1, 2, 3]], 4, threads=1, warmup=0) is None
    assert capsys.readouterr().out.strip() == llamacpp_peer.NOT_INSTALLED


def test_peer_skips_a_model_that_is_not_gguf(monkeypatch, capsys):
    # Installed (a stand-in module) but the model is a folder: it says so, loads nothing.
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    assert llamacpp_peer.run_latency("/models/tiny-llama", [[1, 2, 3]], 4, threads=1, warmup=0) is None
    assert "not a .gguf file" in capsys.readouterr().out


def test_bench_latency_rejects_an_unknown_peer(tiny_model, tmp_path, capsys):
    # before the engine starts: no figures, the error says which peers there are
    assert _bench(tiny_model, tmp_path / "latency.json", "--peers", "vllm") == 2
    assert "--peers takes llamacpp or none; got 'vllm'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_peer_greedy_tokens_match_the_pinned_reference(threads):
    llama_cpp = pytest.importorskip("llama_cpp")
    from shoal.workers.model_executor.loader.model_loader import default_model_path

    pinned = json.load(open(PINNED))
    if llama_cpp.__version__ != pinned["llama_cpp_python"]:  # another llama.cpp computes other bits
        pytest.skip(
            f"llama-cpp-python {llama_cpp.__version__} is installed, the reference was pinned with "
            f"{pinned['llama_cpp_python']} (scripts/pin_llamacpp_reference.py pins it anew)"
        )
    prompt = pinned["prompts"][0]
    llm = llamacpp_peer.load(default_model_path(), threads)
    try:
        # each row's dot products are the same however ggml splits rows over threads
        assert llamacpp_peer.greedy(llm, prompt["token_ids"], pinned["new_tokens"]) == prompt["continuation"]
    finally:
        llm.close()
