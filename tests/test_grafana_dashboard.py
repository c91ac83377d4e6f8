"""deploy/grafana/shoal.json: importable as is, and every query asks for metrics the routers expose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shoal.router.observability.metrics import METRIC_NAMES as EXPOSED

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "shoal.json"

# The names each router exposes at /metrics, by kind (checked against shoal.router.observability.metrics below).
GAUGES = {
    "shoal:num_requests_running",
    "shoal:num_requests_waiting",
    "shoal:kv_cache_usage_perc",
    "shoal:num_free_kv_blocks",
}
COUNTERS = {
    "shoal:prompt_tokens_total",
    "shoal:generation_tokens_total",
    "shoal:num_preemptions_total",
    "shoal:prefix_cache_queries_total",
    "shoal:prefix_cache_hits_total",
    "shoal:request_success_total",
}
# With KV tiers: read from the workers, the kv_offload_ ones per tier too (by their vLLM prefixes).
KV_TIERS = {n for n in EXPOSED if n.startswith(("shoal:external_prefix_cache_", "shoal:kv_offload_"))}
assert len(KV_TIERS) == 7
HISTOGRAMS = {
    "shoal:time_to_first_token_seconds",
    "shoal:inter_token_latency_seconds",
    "shoal:e2e_request_latency_seconds",
    "shoal:request_queue_time_seconds",
    "shoal:request_prompt_tokens",
    "shoal:request_generation_tokens",
}
# The router's own, one series per router (not read from the workers).
ROUTER_GAUGES = {"shoal:router_event_loop_lag_seconds"}
METRIC_NAMES = GAUGES | ROUTER_GAUGES | COUNTERS | HISTOGRAMS | KV_TIERS
assert METRIC_NAMES == set(EXPOSED), "the dashboard's list of series and /metrics' differ"
# Read from the workers and exposed identically by every router: summing them over routers would count each
# worker once per router, so every query over them must go through `max by (worker)`.
WORKER_METRICS = (
    GAUGES
    | KV_TIERS
    | {
        "shoal:num_preemptions_total",
        "shoal:prefix_cache_queries_total",
        "shoal:prefix_cache_hits_total",
    }
)

_METRIC = re.compile(r"shoal:[a-z0-9_:]+")  # digits too: e2e_request_latency_seconds
_HIST_SUFFIX = re.compile(r"_(bucket|sum|count)$")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    """Every panel, rows and the panels inside collapsed rows included."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in _panels(dash) for t in p.get("targets", [])]


def _metrics(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for _, t in _targets(dash)]


def test_model_and_inputs(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard.get("id") is None  # an import must not collide with an existing dashboard's id
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource" and inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"


def test_panels_have_unique_ids_and_non_overlapping_places(dashboard):
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert {"x", "y", "w", "h"} <= g.keys(), p["title"]
        assert 0 <= g["x"] and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    assert {p["type"] for p in panels} <= {"row", "timeseries", "stat", "bargauge"}


def test_every_target_uses_the_prometheus_input(dashboard):
    targets = _targets(dashboard)
    assert targets
    for panel, t in targets:
        assert t["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert t["expr"].strip() and t["refId"]
    for panel in _panels(dashboard):
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


def test_queries_use_only_exposed_metrics(dashboard):
    seen = set()
    for expr in _exprs(dashboard):
        names = _metrics(expr)
        assert names, expr
        for name in names:
            base = _HIST_SUFFIX.sub("", name)
            assert name in METRIC_NAMES or base in HISTOGRAMS, f"unknown metric {name} in {expr}"
            assert name not in HISTOGRAMS, f"a histogram is queried through _bucket/_sum/_count: {expr}"
            seen.add(base if base in HISTOGRAMS else name)
        # histogram_quantile only makes sense over a histogram's buckets, aggregated keeping `le`
        if "histogram_quantile" in expr:
            assert re.search(r"histogram_quantile\(0?\.\d+, sum by \(le\) \(rate\(shoal:[a-z0-9_]+_bucket", expr), expr
        # the template variable restricts every selector
        assert expr.count("shoal:") == expr.count('{model_name=~"$model_name"}'), expr
    assert seen == METRIC_NAMES, f"metrics no panel shows: {sorted(METRIC_NAMES - seen)}"


def test_worker_metrics_are_never_summed_over_routers(dashboard):
    for expr in _exprs(dashboard):
        if _metrics(expr) & WORKER_METRICS:
            # every selector of a worker metric sits right inside a max by (worker) (...), or by (worker, tier)
            for m in _METRIC.finditer(expr):
                if m.group() in WORKER_METRICS:
                    before = expr[: m.start()]
                    assert re.search(r"max by \(worker(, tier)?\) \((rate\()?$", before), expr


def test_model_name_variable(dashboard):
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert var["type"] == "query"
    assert var["datasource"]["uid"] == "${DS_PROMETHEUS}"
    query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    assert query == "label_values(shoal:num_requests_running, model_name)"


def _find(dashboard, pred) -> list[dict]:
    return [p for p in _panels(dashboard) if p.get("targets") and pred([t["expr"] for t in p["targets"]])]


def _quantile_panel(dashboard, metric: str, quantiles: set[str]) -> list[dict]:
    def pred(exprs):
        qs = {m.group(1) for e in exprs for m in re.finditer(r"histogram_quantile\((0?\.\d+), .*" + metric, e)}
        return quantiles <= qs

    return _find(dashboard, pred)


def test_panels_cover_what_an_operator_needs(dashboard):
    def uses(*metrics, also=""):
        return lambda exprs: all(any(m in e and also in e for e in exprs) for m in metrics)

    throughput = _find(dashboard, uses("rate(shoal:generation_tokens_total"))
    assert throughput and any(p["type"] == "timeseries" for p in throughput), "tokens/s"
    assert any("tok/s" in p["fieldConfig"]["defaults"].get("unit", "") for p in throughput)
    assert _quantile_panel(dashboard, "shoal:time_to_first_token_seconds_bucket", {"0.5", "0.99"}), "TTFT p50/p99"
    itl = _quantile_panel(dashboard, "shoal:inter_token_latency_seconds_bucket", {"0.5", "0.99"})
    assert itl, "ITL percentiles"
    assert _find(dashboard, uses("shoal:num_requests_waiting", "shoal:num_requests_running")), "queue"
    kv = _find(dashboard, uses("shoal:kv_cache_usage_perc", also="max by (worker)"))
    assert any("{{worker}}" in t["legendFormat"] for p in kv for t in p["targets"]), "KV usage per worker"
    assert any(p["type"] == "bargauge" for p in kv)
    assert _find(dashboard, uses("shoal:num_preemptions_total")), "preemptions"
    hit = _find(
        dashboard,
        lambda exprs: any(
            "prefix_cache_hits_total" in e and "/" in e and "prefix_cache_queries_total" in e for e in exprs
        ),
    )
    assert hit and all(p["fieldConfig"]["defaults"]["unit"] == "percentunit" for p in hit), "prefix hit rate"
