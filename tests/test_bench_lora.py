"""`shoal bench lora` end to end on a tiny model: the base run, a run with
as many adapters as slots and one that swaps, their ratios and adapter
load times in the JSON; the adapters it writes load as peft's format."""

from __future__ import annotations

import json

from shoal.benchmarks.lora import write_adapter
from shoal.workers.lora import LoRARequest
from shoal.workers.lora.peft_adapter import load_peft_adapter
from shoal.workers.model_executor.loader.model_loader import load_model_files


def test_bench_lora_runs_and_reports(tiny_model, tmp_path, capsys):
    from shoal.cluster.cli import main

    out = tmp_path / "lora.json"
    argv = ["bench", "lora", "--model", tiny_model, "--num-prompts", "6", "--adapters", "2,6", "--max-loras", "2"]
    argv += ["--rank", "4", "--num-threads", "1", "--num-kv-blocks", "256", "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"base", "2 adapters", "6 adapters"}
    assert runs["base"]["output_tokens"] == runs["2 adapters"]["output_tokens"] == runs["6 adapters"]["output_tokens"]
    assert runs["2 adapters"]["slot_fills"] <= 2 < runs["6 adapters"]["slot_fills"]  # 6 adapters through 2 slots
    for name in ("2 adapters", "6 adapters"):
        assert runs[name]["vs_base"] > 0 and runs[name]["adapter_load_s"] >= 0
    assert runs["2 adapters"]["goal"] == 0.85 and runs["6 adapters"]["goal"] == 0.7
    printed = capsys.readouterr().out
    assert "6 adapters / 2 slots" in printed and "the base (goal 0.7x)" in printed


def test_the_written_adapter_is_peft_format(tiny_model, tmp_path):
    cfg = load_model_files(tiny_model).config
    path = write_adapter(str(tmp_path / "a"), cfg, rank=8, seed=0)
    adapter = load_peft_adapter(LoRARequest("a", 1, path), cfg, max_rank=8)
    assert adapter.rank == 8 and adapter.scaling == 2.0
    assert len(adapter.weights) == 7 * cfg.num_hidden_layers
