"""What one request's spans cost: the router's span with its prepare and
route children and the worker's span with its events, made as the serving
path makes them and exported over OTLP/gRPC to a sink in this process
(whose own receiving counts too). `shoal bench serve --tracing` prints it
after its run; `python -m shoal.benchmarks.trace_cost` alone.

It turns tracing on in this process, so it runs last."""

from __future__ import annotations

import os
import time

from shoal.benchmarks.otlp_sink import OtlpSink

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def cpu_us_per_request(n: int = 1000) -> float:
    from shoal.proto import tracing as wt
    from shoal.proto.messages import RequestFinished
    from shoal.proto.tracing import finish_worker_span
    from shoal.router.observability import tracing as rt
    from shoal.router.routing.replica_stats import ReplicaFigures
    from shoal.workers import SamplingParams
    from shoal.workers.core.sequence import RequestTimings

    with OtlpSink() as sink:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
        if not rt.configure("shoal-trace-cost"):
            raise RuntimeError("tracing did not turn on")
        params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)
        figs, names = [ReplicaFigures(free_blocks=100, running=2, waiting=1)] * 4, ["w0", "w1", "w2", "w3"]

        def one(i: int) -> None:
            span = rt.start_request_span(
                rt.context_from_headers({"traceparent": TRACEPARENT}), "chat", "m", request_id=f"r{i}", stream=True
            )
            with rt.stage_span(span, "shoal.prepare"):
                rt.set_request_params(span, **rt.request_params(params))
            carrier = rt.inject(span)
            rt.trace_route(carrier, names, figs, 1, "kv")
            worker = wt.start_worker_span(carrier, f"r{i}", {"shoal.worker": "w1"})
            now = time.time()
            f = RequestFinished("length", None, "w1", 128, 0, 64, 0.1, 0.1, 0.8, 0.2, 1.0)
            finish_worker_span(worker, RequestTimings(now - 1.0, now - 0.9, now - 0.8, now), f)
            rt.finish_request_span(span, f, response_model="m")

        for i in range(100):  # warm up (imports, the exporter's channel)
            one(i)
        wt.flush()
        c0 = time.process_time()
        for i in range(n):
            one(i)
            if i % 256 == 255:  # stay under the batch queue's 2048 spans, as real traffic does
                wt.flush()
        wt.flush()
        return (time.process_time() - c0) / n * 1e6


if __name__ == "__main__":
    print(f"{cpu_us_per_request():.0f} us of CPU per request (4 spans, OTLP export and receipt included)")
