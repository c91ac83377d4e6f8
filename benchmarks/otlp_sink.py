"""A trace sink for `shoal bench serve --tracing`: a real OTLP/gRPC
TraceService on a free localhost port that counts the spans it is sent and
keeps none, so the traced cluster pays for making and exporting its spans
and nothing else."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class _Counter(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink):
        self.sink = sink

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.sink.lock:
            self.sink.num_spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpSink:
    def __init__(self):
        self.num_spans = 0
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Counter(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpSink:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=1.0)
