"""Benches against a baseline revision: `shoal bench prepare --baseline` and
`python -m shoal.benchmarks.ab` time both trees in one run, each side in its
own interpreter, and leave no git worktree behind."""

from __future__ import annotations

import json
import subprocess

from shoal.benchmarks import ab
from shoal.benchmarks.baseline_tree import ROOT
from shoal.cluster.cli import main


def _worktrees() -> str:
    return subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True, text=True, check=True).stdout


def test_bench_prepare_times_the_baseline_and_this_tree(tmp_path):
    before = _worktrees()
    out = tmp_path / "prepare.json"
    args = ["bench", "prepare", "--baseline", "HEAD", "--tokens", "64", "--rounds", "1", "--calls", "5"]
    assert main([*args, "--output", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 64 and row["baseline_us"] > 0 and row["current_us"] > 0
    assert _worktrees() == before


def test_ab_runs_a_bench_on_both_sides_in_turn(tmp_path):
    before = _worktrees()
    bench = ["bench", "prepare", "--baseline", "HEAD", "--tokens", "64", "--rounds", "1", "--calls", "5"]
    assert ab.main(["HEAD", "2", str(tmp_path), "--", *bench]) == 0
    for side in ("baseline", "current"):
        for r in (1, 2):
            assert json.loads((tmp_path / f"{side}_{r}.json").read_text())["rows"][0]["tokens"] == 64
    assert ab.main(["HEAD", "1"]) == 2  # usage
    assert _worktrees() == before
