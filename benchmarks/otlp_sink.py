"""An OTLP/gRPC trace receiver on a free localhost port: a real
TraceService that the traced processes export to (OTEL_EXPORTER_OTLP_ENDPOINT
= its `endpoint`). OtlpSink counts the spans it is sent and keeps none, so a
traced cluster pays for making and exporting its spans and nothing else
(`shoal bench serve --tracing`, trace_cost.py); OtlpCollector also keeps
each span, flattened to plain values, for tests to read:

    with OtlpCollector() as c:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": c.endpoint}
        ...
        span = c.wait_for(lambda s: s.name == "chat tiny")
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass
class Event:
    name: str
    attributes: dict
    time_unix_nano: int


@dataclass
class Span:
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str  # "SERVER", "INTERNAL", "CLIENT", ...
    attributes: dict
    events: list[Event]
    status_code: str  # "UNSET", "OK" or "ERROR"
    status_message: str
    service_name: str | None
    resource: dict = field(default_factory=dict)
    start_unix_nano: int = 0
    end_unix_nano: int = 0

    def event(self, name: str) -> Event | None:
        return next((e for e in self.events if e.name == name), None)


def any_value(v):
    """An OTLP AnyValue as a Python value."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, which)  # string_value, bool_value, int_value, double_value, bytes_value


def attributes(kvs) -> dict:
    return {kv.key: any_value(kv.value) for kv in kvs}


def _span(s, resource: dict) -> Span:
    return Span(
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex(),
        name=s.name,
        kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
        attributes=attributes(s.attributes),
        events=[Event(e.name, attributes(e.attributes), e.time_unix_nano) for e in s.events],
        status_code=trace_pb2.Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
        status_message=s.status.message,
        service_name=resource.get("service.name"),
        resource=resource,
        start_unix_nano=s.start_time_unix_nano,
        end_unix_nano=s.end_time_unix_nano,
    )


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink):
        self.sink = sink

    def Export(self, request, context):
        self.sink._received(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    """Counts the spans it receives (num_spans); started and stopped by `with`."""

    def __init__(self):
        self.num_spans = 0
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _received(self, request) -> None:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.num_spans += n

    def start(self) -> OtlpSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1.0).wait()

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OtlpCollector(OtlpSink):
    """An OtlpSink that also keeps every span, flattened (a Span each)."""

    def __init__(self):
        super().__init__()
        self._spans: list[Span] = []
        self._cond = threading.Condition(self.lock)

    def _received(self, request) -> None:
        got = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                got.extend(_span(s, resource) for s in ss.spans)
        with self._cond:
            self.num_spans += len(got)
            self._spans.extend(got)
            self._cond.notify_all()

    def spans(self, name: str | None = None) -> list[Span]:
        """Every span received so far (those called name, if given)."""
        with self._cond:
            return [s for s in self._spans if name is None or s.name == name]

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()

    def wait_for(self, predicate, timeout: float = 10.0) -> Span:
        """The first received span for which predicate(span) holds, waiting
        up to timeout seconds for it; TimeoutError naming what did arrive."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for s in self._spans:
                    if predicate(s):
                        return s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching span in {timeout} s; got {[s.name for s in self._spans]}")
                self._cond.wait(left)
