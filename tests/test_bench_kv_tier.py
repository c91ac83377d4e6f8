"""`shoal bench kv-tier` end to end on a tiny model: the tiers serve what the
pool lost, with the same replies, a restarted engine finds its blocks, and
engines taking turns at random find each other's in the cluster tier."""

from __future__ import annotations

import json

import pytest


def test_bench_kv_tier_runs_and_reports(tiny_model, tmp_path, capsys):
    from shoal.cluster.cli import main

    out = tmp_path / "kv_tier.json"
    argv = ["bench", "kv-tier", "--model", tiny_model, "--conversations", "6", "--turns", "3-4"]
    argv += ["--system-len", "96", "--turn-len", "20-40", "--reply-len", "4-8", "--unique-requests", "3"]
    argv += ["--host-bytes", str(1 << 20), "--num-kv-blocks", "20", "--num-threads", "1", "--output", str(out)]
    argv += ["--routing", "random"]
    assert main(argv) == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert report["same_replies"] and len({r["replies_sha256"] for r in runs.values()}) == 1
    rr = "2 engines random"
    assert set(runs) == {"tiers off", "host tier", "disk tier", f"{rr}, tiers off", f"{rr}, cluster tier"}
    # The pool alone loses the conversations between their turns; each tier gives back what it lost.
    for name in ("host tier", "disk tier"):
        assert runs[name]["hit_share_of_ideal"] > max(0.9, runs["tiers off"]["hit_share_of_ideal"]), name
        assert runs[name]["tiers"][name.split()[0]]["hit_tokens"] > 0
    # A turn lands where the last one did not; the cluster tier has the other engine's blocks.
    cluster = runs[f"{rr}, cluster tier"]
    assert cluster["moved_turn_share"] > 0
    assert cluster["hit_share_of_ideal"] > max(0.9, runs[f"{rr}, tiers off"]["hit_share_of_ideal"])
    assert cluster["tiers"]["cluster"]["hit_tokens"] > 0
    assert report["restart"]["hit_share"] > 0.9
    costs = report["costs"]
    assert costs["prefill_ms_per_token"] > 0 and costs["host_ms_per_block"] > 0 and costs["disk_ms_per_block"] > 0
    # ...and what a block loaded in the runs took, tier by tier, as the engines measured it.
    for name, tier in (("host tier", "host"), ("disk tier", "disk"), (f"{rr}, cluster tier", "cluster")):
        assert runs[name]["fetch_ms_per_block"][tier] > 0
    printed = capsys.readouterr().out
    assert "after a restart on the disk tier's folder" in printed and "nothing reusable" in printed


@pytest.mark.slow
def test_bench_kv_tier_serve_on_real_workers(tiny_model, tmp_path, capsys):
    """--serve: two real workers in a local Ray cluster, turns routed round-robin;
    with the cluster tier a moved turn finds the other worker's blocks."""
    from shoal.cluster.cli import main

    out = tmp_path / "kv_tier_serve.json"
    argv = ["bench", "kv-tier", "--serve", "--serve-routing", "round-robin", "--model", tiny_model]
    argv += ["--conversations", "6", "--turns", "3-4", "--system-len", "96", "--turn-len", "20-40"]
    argv += ["--reply-len", "4-8", "--num-kv-blocks", "20", "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().out[-3000:]
    report = json.loads(out.read_text())
    runs = report["serve_runs"]
    off, on = runs["2 workers round-robin, tiers off"], runs["2 workers round-robin, cluster tier"]
    assert report["same_replies"]
    assert on["moved_turn_share"] > 0.3  # the shuffled order moves turns between the workers
    assert on["hit_share_of_ideal"] > max(0.9, off["hit_share_of_ideal"])
    # counted by the workers: blocks loaded from the cluster tier, and what each took
    assert on["tier_hit_tokens"]["cluster"] > 0 and on["fetch_ms_per_block"]["cluster"] > 0
    assert "cluster" not in off["tier_hit_tokens"] and on["prefill_ms_per_token"] > 0
