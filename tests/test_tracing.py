"""Tracing (proto/tracing.py, router/observability/tracing.py) against a real OTLP/gRPC
collector, no Ray. The SDK's global TracerProvider can be set once per
process, so each side runs in its own subprocess: the router's span joins a
client's traceparent, and a worker process's span, started from the carrier
the router injected, joins the router's. Off by default, and a bad OTEL_*
value is an error naming the variable."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from shoal.benchmarks.otlp_sink import OtlpCollector
from shoal.proto import tracing

ROUTER = textwrap.dedent("""
    import json, sys
    from starlette.datastructures import Headers
    from shoal.router.observability import tracing as rt
    from shoal.router.fronts.frontend import ServingError
    from shoal.proto.sampling_params import SamplingParams
    from shoal.proto.messages import RequestFinished

    assert rt.configure("shoal-router") and rt.configure("other")  # the second call changes nothing
    traceparent = sys.argv[1]
    span = rt.start_request_span(rt.context_from_headers(Headers(headers={"TraceParent": traceparent})), "chat",
                                 "tiny-llama", request_id="chatcmpl-1", client_request_id="mine", stream=True)
    with rt.stage_span(span, num_messages=2) as prep:
        prep.set_attribute("shoal.prompt_tokens", 7)
    rt.set_request_params(span, **rt.request_params(SamplingParams(max_tokens=16, temperature=0.5, top_p=0.9, seed=7)))
    rt.route_span(span, [{"worker": "w0", "free_blocks": 10, "queue_depth": 0, "cost": 1},
                         {"worker": "w1", "free_blocks": 3, "queue_depth": 2, "cost": 2.5}], "w0")
    carrier = rt.inject(span)
    rt.failed_over(span, "w0", 3, reason="unavailable")
    rt.route_span(carrier, [{"worker": "w1", "free_blocks": 3, "queue_depth": 2}], "w1", attempt=2)
    rt.failed_over(carrier, "w1", 4)  # where only the carrier is at hand (the failover pool)
    rt.finish_request_span(span, RequestFinished("stop", None, "w1", 7, 3, 5, 0.01, prefill_s=0.09,
                                                 time_to_first_token_s=0.1, total_s=0.5), response_model="tiny-llama")
    rt.end_request_span(span)  # already ended: nothing happens

    # A refused request from a gRPC client.
    failing = rt.start_request_span(rt.context_from_metadata([("traceparent", traceparent), ("k-bin", b"x")]),
                                    "text_completion", "tiny-llama", request_id="cmpl-2")
    try:
        with rt.stage_span(failing):
            raise ServingError("invalid", "prompt is empty", "prompt")
    except ServingError as e:
        rt.fail_request_span(failing, e)
    assert rt.flush(10)
    print(json.dumps(carrier))
""")

WORKER = textwrap.dedent("""
    import json, sys, time
    from shoal.proto import tracing
    from shoal.proto.messages import RequestFinished

    assert tracing.configure("shoal-worker")
    t0 = time.time()
    span = tracing.start_worker_span(json.loads(sys.argv[1]), "chatcmpl-1", {"shoal.worker": "w1"}, start_s=t0)
    for i, name in enumerate(["scheduled", "preempted", "resumed", "first_token"]):
        tracing.worker_event(span, name, at_s=t0 + 0.001 * (i + 1), num_computed_tokens=i)
    tracing.end_worker_span(span, RequestFinished("stop", None, "w1", 7, 3, 5, 0.01), num_preemptions=1)
    assert tracing.flush(10)
""")

OFF = textwrap.dedent("""
    import os, sys
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan

    made = []
    init = NonRecordingSpan.__init__
    NonRecordingSpan.__init__ = lambda self, *a, **k: (made.append(1), init(self, *a, **k))[1]
    from shoal.router.observability import tracing as rt
    from shoal.proto import tracing

    tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    for env in ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1], "OTEL_TRACES_EXPORTER": "none"},
                {"OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1], "OTEL_SDK_DISABLED": "true"}):
        os.environ.update(env)
        assert tracing.configure("shoal-router") is False and not tracing.enabled, env
        assert rt.context_from_headers({"traceparent": tp}) is None and rt.context_from_metadata(None) is None
        span = rt.start_request_span(None, "chat", "m", request_id="r", max_tokens=5)
        assert span is None and rt.inject(span) is None
        with rt.stage_span(span) as prep:
            assert prep is None
        rt.route_span(span, [{"worker": "w", "free_blocks": 1, "queue_depth": 0}], "w")
        rt.failed_over(span, "w", 1)
        rt.finish_request_span(span, None)
        rt.fail_request_span(span, ValueError("x"))
        rt.end_request_span(span)
        assert tracing.start_worker_span({"traceparent": tp}, "r") is None
        tracing.worker_event(None, "scheduled")
        tracing.end_worker_span(None)
        assert tracing.flush(1)
        for k in env:
            del os.environ[k]
    assert made == [], "the off path made span objects"
    assert "opentelemetry.sdk.trace" not in sys.modules, "the off path imported the SDK"
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    print("off")
""")


def run(script: str, *args: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env={**base, **env}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as c:
        yield c


def test_router_and_worker_spans_join_the_client_trace(collector):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    out = run(ROUTER, f"00-{trace_id}-{client_span}-01", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint)
    carrier = json.loads(out.strip().splitlines()[-1])
    assert set(carrier) >= {"traceparent"}
    ours = [s for s in collector.spans() if s.trace_id == trace_id]

    req = collector.wait_for(lambda s: s.trace_id == trace_id and s.name == "chat tiny-llama")
    assert (req.parent_span_id, req.kind, req.service_name) == (client_span, "SERVER", "shoal-router")
    assert req.status_code == "UNSET"
    a = req.attributes
    assert {
        k: a[k]
        for k in (
            "gen_ai.operation.name",
            "gen_ai.system",
            "gen_ai.request.model",
            "gen_ai.response.model",
            "gen_ai.response.id",
            "gen_ai.request.max_tokens",
            "gen_ai.request.temperature",
            "gen_ai.request.top_p",
            "gen_ai.request.seed",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "gen_ai.response.finish_reasons",
            "shoal.cached_prompt_tokens",
            "shoal.worker",
            "shoal.client_request_id",
            "shoal.stream",
        )
    } == {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "shoal",
        "gen_ai.request.model": "tiny-llama",
        "gen_ai.response.model": "tiny-llama",
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": ["stop"],
        "shoal.cached_prompt_tokens": 3,
        "shoal.worker": "w1",
        "shoal.client_request_id": "mine",
        "shoal.stream": True,
    }
    for key, want in (
        ("shoal.queue_s", 0.01),
        ("shoal.ttft_s", 0.1),
        ("shoal.prefill_s", 0.09),
        ("shoal.decode_s", 0.4),
        ("shoal.e2e_s", 0.5),
    ):
        assert a[key] == pytest.approx(want), key
    assert "gen_ai.request.top_k" not in a  # -1: off
    fo = req.event("failed_over")
    assert fo.attributes == {"shoal.from_worker": "w0", "shoal.streamed_tokens": 3, "shoal.reason": "unavailable"}
    assert carrier["traceparent"] == f"00-{trace_id}-{req.span_id}-01"

    children = [s for s in ours if s.parent_span_id == req.span_id]
    prep = next(s for s in children if s.name == "shoal.prepare")
    assert prep.attributes == {"num_messages": 2, "shoal.prompt_tokens": 7} and prep.status_code == "UNSET"
    routes = sorted((s for s in children if s.name == "shoal.route"), key=lambda s: s.start_unix_nano)
    assert [r.attributes for r in routes] == [
        {
            "shoal.route.chosen": "w0",
            "shoal.route.num_candidates": 2,
            "shoal.route.workers": ["w0", "w1"],
            "shoal.route.free_blocks": [10, 3],
            "shoal.route.queue_depths": [0, 2],
            "shoal.route.costs": [1.0, 2.5],
        },
        {
            "shoal.route.chosen": "w1",
            "shoal.route.num_candidates": 1,
            "shoal.route.workers": ["w1"],
            "shoal.route.free_blocks": [3],
            "shoal.route.queue_depths": [2],
            "attempt": 2,
        },
    ]

    fo_span = next(s for s in children if s.name == "shoal.failed_over")
    assert fo_span.event("failed_over").attributes == {"shoal.from_worker": "w1", "shoal.streamed_tokens": 4}

    failed = next(s for s in ours if s.name == "text_completion tiny-llama")
    assert failed.parent_span_id == client_span and failed.status_code == "ERROR"
    assert failed.status_message == "prompt is empty" and failed.attributes["error.type"] == "invalid"
    assert failed.event("exception").attributes["exception.type"].endswith("ServingError")
    failed_prep = next(s for s in ours if s.parent_span_id == failed.span_id)
    assert failed_prep.status_code == "ERROR"

    # The worker, in another process, from the carrier alone.
    run(WORKER, json.dumps(carrier), OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint, OTEL_SERVICE_NAME="my-workers")
    w = collector.wait_for(lambda s: s.trace_id == trace_id and s.name == tracing.WORKER_SPAN)
    assert (w.parent_span_id, w.kind, w.service_name) == (req.span_id, "SERVER", "my-workers")
    assert w.resource["shoal.component"] == "shoal-worker"
    assert [e.name for e in w.events] == ["scheduled", "preempted", "resumed", "first_token"]
    assert w.events[1].attributes == {"num_computed_tokens": 1}
    assert {
        k: w.attributes[k]
        for k in (
            "shoal.request_id",
            "shoal.worker",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "shoal.cached_prompt_tokens",
            "gen_ai.response.finish_reasons",
            "num_preemptions",
        )
    } == {
        "shoal.request_id": "chatcmpl-1",
        "shoal.worker": "w1",
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 5,
        "shoal.cached_prompt_tokens": 3,
        "gen_ai.response.finish_reasons": ["stop"],
        "num_preemptions": 1,
    }


def test_off_by_default(collector):
    before = len(collector.spans())
    assert run(OFF, collector.endpoint).strip().endswith("off")
    assert len(collector.spans()) == before  # nothing was exported


def _clear_otel(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr(tracing, "enabled", False)


@pytest.mark.parametrize(
    "var, value",
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grcp"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ("OTEL_TRACES_EXPORTER", "zipkin"),
    ],
)
def test_bad_setting_names_its_variable(monkeypatch, var, value):
    # Raised before any provider is made, so this process's global state is untouched.
    _clear_otel(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}={value!r}"):
        tracing.configure("shoal-test")
    assert not tracing.enabled and tracing._provider is None


def test_http_protobuf_needs_its_package(monkeypatch):
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None:
        pytest.skip("the http/protobuf exporter is installed")
    _clear_otel(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(
        ValueError,
        match="OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs the opentelemetry-exporter-otlp-proto-http package",
    ):
        tracing.configure("shoal-test")


def test_otel_env_passes_on_what_is_set(monkeypatch):
    _clear_otel(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_UNRELATED", "x")
    assert tracing.otel_env() == {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
    }
    assert all(k.startswith("OTEL_") for k in tracing.ENV_VARS)
