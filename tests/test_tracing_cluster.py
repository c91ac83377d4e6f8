"""Slow tier: traces from a real local Ray cluster (two workers on the tiny
model), exported over OTLP/gRPC to a collector run in the test. For an HTTP
and a gRPC request, each with a client traceparent, and one without: one
connected trace per request, router span -> prepare, route and worker spans
across the router's and the worker's processes, with GenAI attributes that
equal the response."""

from __future__ import annotations

import secrets

import grpc
import httpx
import pytest
from serving import local_cluster_app
from test_failover_cluster import wait_for_workers

from shoal.benchmarks.otlp_sink import OtlpCollector
from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def _http(base: str, traceparent: str | None) -> dict:
    headers = {"traceparent": traceparent} if traceparent else {}
    r = httpx.post(
        base + "/v1/completions",
        headers=headers,
        timeout=120,
        json={"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()
    body = r.json()
    return {
        "id": body["id"],
        "prompt": body["usage"]["prompt_tokens"],
        "output": body["usage"]["completion_tokens"],
        "reason": body["choices"][0]["finish_reason"],
    }


def _grpc(addr: str, traceparent: str) -> dict:
    with grpc.insecure_channel(addr) as ch:
        req = pb.GenerateRequest(
            text="Paged attention keeps",
            sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        out = {}
        for m in pb_grpc.ShoalStub(ch).Generate(req, metadata=(("traceparent", traceparent),), timeout=120):
            out["id"] = m.request_id
            if m.HasField("finished"):
                u = m.finished.usage
                out.update(prompt=u.prompt_tokens, output=u.completion_tokens, reason=m.finished.finish_reason)
    return out


def _check_trace(col: OtlpCollector, trace_id: str, client_span: str | None, got: dict, operation: str) -> None:
    worker = col.wait_for(lambda s: s.trace_id == trace_id and s.name == "shoal.worker generate", timeout=30)
    router = col.wait_for(lambda s: s.trace_id == trace_id and s.kind == "SERVER" and s.service_name == "shoal-router")
    spans = [s for s in col.spans() if s.trace_id == trace_id]
    names = sorted(s.name for s in spans)
    assert names == sorted([router.name, "shoal.prepare", "shoal.route", "shoal.worker generate"]), names
    # The client's span is the root's parent; everything else hangs off the router's span.
    assert router.parent_span_id == (client_span or "")
    for s in spans:
        if s is not router:
            assert s.parent_span_id == router.span_id, s.name
    assert worker.service_name == "shoal-worker" and worker.kind == "SERVER"
    a = router.attributes
    assert router.name == f"{operation} {a['gen_ai.request.model']}"
    assert a["gen_ai.operation.name"] == operation and a["gen_ai.response.id"] == got["id"]
    assert a["gen_ai.usage.input_tokens"] == got["prompt"] and a["gen_ai.usage.output_tokens"] == got["output"]
    assert a["gen_ai.response.finish_reasons"] == [got["reason"]] and a["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert 0 < a["shoal.ttft_s"] <= a["shoal.e2e_s"] and a["shoal.queue_s"] >= 0 and a["shoal.prefill_s"] >= 0
    w = worker.attributes
    assert w["gen_ai.usage.output_tokens"] == got["output"] and w["shoal.worker"] == a["shoal.worker"]
    assert [e.name for e in worker.events] == ["scheduled", "first_token"]
    route = next(s for s in spans if s.name == "shoal.route").attributes
    assert len(route["shoal.route.workers"]) == 2 and route["shoal.route.chosen"] == a["shoal.worker"]
    assert len(route["shoal.route.free_blocks"]) == 2 and len(route["shoal.route.queue_depths"]) == 2


def test_http_and_grpc_requests_each_make_one_connected_trace(tiny_model, monkeypatch):
    # The collector's port is bound now, its gRPC server started only once Ray is up: ray.init forks,
    # and a fork while this process's gRPC threads are busy ("skipping fork() handlers") left Ray's
    # GCS never starting, twice in full slow-tier runs (the test passed alone).
    col = OtlpCollector()
    # `shoal serve` hands the OTEL_* of its environment to every replica.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", col.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within a fraction of a second
    with (
        local_cluster_app("shoal-traces", model=tiny_model, num_workers=2, num_threads=1, num_kv_blocks=256) as (
            base,
            addr,
        ),
        col,
    ):
        wait_for_workers(addr, 2, 120)
        t_http, c_http = secrets.token_hex(16), secrets.token_hex(8)
        got_http = _http(base, f"00-{t_http}-{c_http}-01")
        t_grpc, c_grpc = secrets.token_hex(16), secrets.token_hex(8)
        got_grpc = _grpc(addr, f"00-{t_grpc}-{c_grpc}-01")
        got_root = _http(base, None)
        _check_trace(col, t_http, c_http, got_http, "text_completion")
        _check_trace(col, t_grpc, c_grpc, got_grpc, "text_completion")
        grpc_attrs = col.wait_for(
            lambda s: s.trace_id == t_grpc and s.kind == "SERVER" and s.service_name == "shoal-router"
        ).attributes
        assert (grpc_attrs["gen_ai.request.temperature"], grpc_attrs["gen_ai.request.seed"]) == (
            pytest.approx(0.7),
            5,
        )
        # Without a traceparent the router's span is the root of a trace of its own.
        root = col.wait_for(lambda s: s.attributes.get("gen_ai.response.id") == got_root["id"], timeout=30)
        assert root.trace_id not in (t_http, t_grpc)
        _check_trace(col, root.trace_id, None, got_root, "text_completion")
