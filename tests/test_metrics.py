"""GET /metrics and /api/status in-process over real Workers, read with
prometheus_client's own parser: counters move by exactly the tokens served,
histograms count every request, gauges return to idle."""

from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families
from serving import http_client, make_frontend

from shoal.router.observability.metrics import METRIC_NAMES, token_buckets


def _scrape(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str, **match) -> float:
    return sum(
        v for (n, labels), v in samples.items() if n == name and all(dict(labels).get(k) == w for k, w in match.items())
    )


def _usage(events_text: str) -> dict:
    chunks = [json.loads(ln[6:]) for ln in events_text.split("\n\n") if ln.startswith("data: {")]
    return next(c["usage"] for c in chunks if c.get("usage"))


def test_counters_histograms_and_gauges_follow_the_requests_served(tiny_model):
    long = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks
    bodies = [
        {"prompt": long, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"prompt": long, "max_tokens": 5, "temperature": 0, "ignore_eos": True},  # a prefix hit
        {"prompt": "Hello there, how are", "max_tokens": 7, "temperature": 0.8, "seed": 3, "ignore_eos": True},
        {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0, "stop": ["zzzz"], "ignore_eos": True},
    ]

    async def main():
        # With a host KV tier, so its series are there too (the pool is large enough that nothing reaches it).
        fe = make_frontend(tiny_model, num_workers=2, api_key="sekret", kv_offload_host_bytes=1 << 20)
        fe.load_snapshot.max_age_s = 0  # each scrape reads the workers as they are now, not 0.5 s ago
        auth = {"Authorization": "Bearer sekret"}
        async with http_client(fe) as c:
            before = (await c.get("/metrics")).text  # no key needed, like /health
            usages = []
            for i, b in enumerate(bodies):
                if i % 2:
                    r = await c.post("/v1/completions", json=b, headers=auth)
                    usages.append(r.json()["usage"])
                else:
                    r = await c.post(
                        "/v1/completions",
                        headers=auth,
                        json=dict(b, stream=True, stream_options={"include_usage": True}),
                    )
                    usages.append(_usage(r.text))
            chat = await c.post(
                "/v1/chat/completions",
                headers=auth,
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 6,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            usages.append(_usage(chat.text))
            # The last stream's end reaches the workers' gauges a moment after its client has it: until idle.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while True:
                resp = await c.get("/metrics")
                idle = _scrape(resp.text)
                busy = sum(
                    _total(idle, f"shoal:{g}")
                    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
                )
                if busy == 0 or loop.time() > deadline:
                    break
                await asyncio.sleep(0.01)
            status_denied = await c.get("/api/status")
            key_required = (await c.get("/api/auth")).json()  # open: tells the page to ask for the key
            status = (await c.get("/api/status", headers=auth)).json()
        return before, resp, usages, status_denied, status, fe, key_required

    before, resp, usages, denied, status, fe, key_required = asyncio.run(main())
    assert key_required == {"api_key_required": True}
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    m0, m = _scrape(before), _scrape(resp.text)
    names = {n for n, _ in m}
    for name in METRIC_NAMES:  # every series is there, counters and histograms under their sample names
        assert any(n == name or n.startswith(name + "_") for n in names), name
    n_req = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    gen = sum(u["completion_tokens"] for u in usages)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    assert _total(m, "shoal:prompt_tokens_total") - _total(m0, "shoal:prompt_tokens_total") == prompt
    assert _total(m, "shoal:generation_tokens_total") - _total(m0, "shoal:generation_tokens_total") == gen
    assert _total(m, "shoal:request_success_total", finished_reason="length") == n_req
    # Every prompt was looked up in the host tier past its device hits; none was there.
    queried = _total(m, "shoal:external_prefix_cache_queries_total") - _total(
        m0, "shoal:external_prefix_cache_queries_total"
    )
    assert queried == prompt - cached > 0
    assert _total(m, "shoal:external_prefix_cache_hits_total") == 0
    assert _total(m, "shoal:kv_offload_usage_perc", tier="host") == 0
    # ...so the load-time histogram of each worker's host tier counts no load, in every bucket.
    assert _total(m, "shoal:kv_offload_load_seconds_count", tier="host") == 0
    assert _total(m, "shoal:kv_offload_load_seconds_bucket", tier="host", le="+Inf") == 0
    assert len({labels for n, labels in m if n == "shoal:kv_offload_load_seconds_bucket"}) == 2 * 11
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert _total(m, f"shoal:{h}_count") == n_req, h
    assert _total(m, "shoal:request_prompt_tokens_sum") == prompt
    assert _total(m, "shoal:request_generation_tokens_sum") == gen
    # Every token after a request's first is one inter-token gap.
    assert _total(m, "shoal:inter_token_latency_seconds_count") == gen - n_req
    # The histograms' buckets are cumulative and end at the count.
    assert _total(m, "shoal:e2e_request_latency_seconds_bucket", le="+Inf") == n_req
    # Both workers served and are labelled by name and model.
    workers = {dict(lb)["worker"] for n, lb in m if n == "shoal:num_free_kv_blocks"}
    assert len(workers) == 2 and {dict(lb)["model_name"] for n, lb in m if n == "shoal:num_free_kv_blocks"} == {
        fe.info.model
    }
    # The workers' prefix-cache counters saw every prompt token, and the repeated prompt hit.
    assert _total(m, "shoal:prefix_cache_queries_total") == prompt
    assert _total(m, "shoal:prefix_cache_hits_total") == cached > 0
    # Idle again: nothing running or waiting, every block free.
    assert _total(m, "shoal:num_requests_running") == 0 and _total(m, "shoal:num_requests_waiting") == 0
    assert _total(m, "shoal:kv_cache_usage_perc") == 0
    assert _total(m, "shoal:num_free_kv_blocks") == sum(w["num_total_blocks"] for w in status["workers"])

    # /api/status: behind the key, and the workers' own counters add up to what was served.
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert status["model"] == fe.info.model and status["num_workers"] == 2 and len(status["workers"]) == 2
    assert sum(w["num_generation_tokens"] for w in status["workers"]) == gen
    assert sum(w["num_finished_requests"] for w in status["workers"]) == n_req
    assert sum(w["num_prompt_tokens"] for w in status["workers"]) == prompt
    rs = status["router_stats"]
    assert rs["num_requests_running"] == 0 and 0 < rs["ttft_p50_s"] <= rs["ttft_p99_s"]
    # The KV tiers' panel: each worker's host tier, looked up past the device hits as /metrics says.
    assert sum(w["kv_tiers"]["host"]["query_tokens"] for w in status["workers"]) == queried
    assert all(w["kv_tiers"]["host"]["total_blocks"] > 0 for w in status["workers"])


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(4) == (1, 2)
