"""OpenTelemetry tracing, shared by the router and the workers.

Off unless the standard OTEL_* environment asks for it (see configure). While
off, every helper returns at its first line (the module flag `enabled`), so
no span object is ever made and the SDK is never imported. A request's trace
crosses the Ray hop as a W3C traceparent/tracestate dict (inject/extract) on
GenerateRequest.trace_context. Only opentelemetry-api is imported up front;
the workers never import the router (router/observability/tracing.py builds on this).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from shoal.proto.messages import RequestFinished

logger = logging.getLogger(__name__)

# What `shoal serve` copies from its environment into every replica's runtime_env.
ENV_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_PROPAGATORS",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
)

WORKER_SPAN = "shoal.worker generate"
WORKER_EVENTS = ("scheduled", "first_token", "preempted", "resumed")

enabled = False  # read as `tracing.enabled`: a from-import would copy it
tracer: trace.Tracer | None = None  # shoal's tracer while enabled
_provider: TracerProvider | None = None  # the SDK TracerProvider this module made
_lock = threading.Lock()
# The Ray hop always speaks W3C trace context, whatever OTEL_PROPAGATORS says
# for clients: router and worker must agree on it.
_hop = TraceContextTextMapPropagator()


def otel_env() -> dict[str, str]:
    """The ENV_VARS set in this process, for a replica's runtime_env."""
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def _env(*names: str) -> tuple[str | None, str | None]:
    """(variable, value) of the first of names that is set and not blank."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None, None


def _exporters() -> list[SpanExporter]:
    """The span exporters the environment asks for ([] = tracing off)."""
    var, value = _env("OTEL_TRACES_EXPORTER")
    if value is None:  # the spec's default is otlp; shoal's is off unless an endpoint is given
        on = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")[1] is not None
        value = "otlp" if on else "none"
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in ("otlp", "console", "none")]
    if unknown:
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={value!r}: unknown exporter {unknown[0]!r} (shoal supports otlp, console, none)"
        )
    out: list[SpanExporter] = []
    for name in dict.fromkeys(n for n in names if n != "none"):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        else:
            out.append(_otlp_exporter())
    return out


def _otlp_exporter() -> SpanExporter:
    # Both exporters read their endpoint, headers, TLS and timeout from the environment.
    var, protocol = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or "grpc").lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter
        except ImportError:
            raise ValueError(
                f"{var}=http/protobuf needs the opentelemetry-exporter-otlp-proto-http package "
                "(pip install it), or use grpc"
            ) from None
        return cast("SpanExporter", HTTPSpanExporter())
    raise ValueError(
        f"{var}={os.environ[cast(str, var)]!r} is not a supported OTLP protocol (use grpc or http/protobuf)"
    )


def configure(service_name: str) -> bool:
    """Turn tracing on if the environment asks for it; returns whether it is
    on. Once on it stays on: later calls (any service name) return True.
    Raises ValueError, naming the variable, on a bad OTEL_* value."""
    global enabled, tracer, _provider
    with _lock:
        if enabled:
            return True
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        exporters = _exporters()  # raises before anything is installed
        if not exporters:
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Resource.create lets the given attributes win over OTEL_SERVICE_NAME and
        # OTEL_RESOURCE_ATTRIBUTES; the environment's name must win over ours.
        attrs = {"shoal.component": service_name}
        if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attrs["service.name"] = service_name
        provider = TracerProvider(resource=Resource.create(attrs))  # the sampler: OTEL_TRACES_SAMPLER[_ARG]
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        # Global too, so other instrumentation joins the same traces; shoal uses
        # its own provider even if another one was installed first.
        trace.set_tracer_provider(provider)
        _provider, tracer = provider, provider.get_tracer("shoal")
        enabled = True
        logger.info(
            "tracing on: service %s, exporters %s",
            provider.resource.attributes.get("service.name"),
            ", ".join(type(e).__module__ for e in exporters),
        )
        return True


def flush(timeout_s: float = 10.0) -> bool:
    """Export every ended span now (tests, shutdown); True when done in time."""
    if _provider is None:
        return True
    return _provider.force_flush(int(timeout_s * 1000))


def inject(span_or_context: trace.Span | Context | None) -> dict[str, str] | None:
    """The W3C carrier ({'traceparent': ..., 'tracestate'?: ...}) naming a
    span (or a Context's span) as parent across the Ray hop; None when off."""
    if not enabled or span_or_context is None:
        return None
    ctx = span_or_context if isinstance(span_or_context, Context) else trace.set_span_in_context(span_or_context)
    carrier: dict[str, str] = {}
    _hop.inject(carrier, context=ctx)
    return carrier or None


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The Context a carrier from inject() names (empty for None)."""
    return _hop.extract(carrier) if carrier else Context()


def ns(t_s: float | None) -> int | None:
    """time.time() seconds -> the SDK's nanoseconds (None stays None: now)."""
    return None if t_s is None else int(t_s * 1e9)


def set_attributes(span: trace.Span | None, attributes: Mapping[str, Any] | None) -> None:
    """Set those of attributes that are not None (the SDK drops None anyway, with a warning)."""
    if span is None or not attributes or not span.is_recording():
        return
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def add_event(
    span: trace.Span | None, name: str, attributes: Mapping[str, Any] | None = None, at_s: float | None = None
) -> None:
    """An event on span, at wall time at_s (time.time(); default now)."""
    if span is None or not span.is_recording():
        return
    attrs = {k: v for k, v in attributes.items() if v is not None} if attributes else None
    span.add_event(name, attrs, timestamp=ns(at_s))


def fail_span(
    span: trace.Span | None, error: BaseException | str, error_type: str | None = None, end: bool = True
) -> None:
    """Record an error (exception or message), set status ERROR, and end span."""
    if span is None or not span.is_recording():
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
        message = str(error) or type(error).__name__
    else:
        message = error
    span.set_attribute(
        "error.type", error_type or (type(error).__name__ if isinstance(error, BaseException) else "error")
    )
    span.set_status(Status(StatusCode.ERROR, message))
    if end:
        span.end()


def end_span(span: trace.Span | None, at_s: float | None = None) -> None:
    """End span if it is still open (safe to call again after finish/fail)."""
    if span is not None and span.is_recording():
        span.end(end_time=ns(at_s))


# ---- the worker's span ---------------------------------------------------------


def start_worker_span(
    carrier: Mapping[str, str] | None,
    request_id: str,
    attributes: Mapping[str, Any] | None = None,
    start_s: float | None = None,
) -> trace.Span | None:
    """The worker's span for one request, a child of the router's span the
    carrier names; None when off or when the router sent no carrier (the
    router traces no request the worker should make a root span for)."""
    if not enabled or not carrier:
        return None
    attrs = {"shoal.request_id": request_id}
    if attributes:
        attrs.update((k, v) for k, v in attributes.items() if v is not None)
    return cast(trace.Tracer, tracer).start_span(
        WORKER_SPAN, context=extract(carrier), kind=SpanKind.SERVER, attributes=attrs, start_time=ns(start_s)
    )


def worker_event(span: trace.Span | None, name: str, at_s: float | None = None, **attributes: Any) -> None:
    """One of WORKER_EVENTS ('scheduled', 'first_token', 'preempted',
    'resumed'), at the engine's wall time at_s (default now)."""
    add_event(span, name, attributes, at_s)


def end_worker_span(
    span: trace.Span | None, finished: object = None, end_s: float | None = None, **attributes: Any
) -> None:
    """End the worker's span with the final figures: `finished` is a
    RequestFinished (or anything with its fields); attributes are added as given."""
    if span is None or not span.is_recording():
        return
    if finished is not None:
        reason = getattr(finished, "finish_reason", None)
        set_attributes(
            span,
            {
                "gen_ai.response.finish_reasons": [reason] if reason else None,
                "gen_ai.usage.input_tokens": getattr(finished, "num_prompt_tokens", None),
                "gen_ai.usage.output_tokens": getattr(finished, "num_output_tokens", None),
                "shoal.cached_prompt_tokens": getattr(finished, "num_cached_tokens", None),
                "shoal.queue_s": getattr(finished, "queue_s", None),
            },
        )
    set_attributes(span, attributes)
    span.end(end_time=ns(end_s))


def finish_worker_span(span: trace.Span | None, timings: Any, finished: RequestFinished) -> None:
    """End the worker's span with the engine's milestones as events, at the
    times they happened (nothing was traced while the request ran): timings
    is the request's RequestTimings (or None), finished its RequestFinished."""
    if timings is not None:
        t = timings
        events = [("scheduled", t.first_scheduled), ("first_token", t.first_token)]
        events += [("preempted", at) for at in t.preempted] + [("resumed", at) for at in t.resumed]
        for name, at in sorted((e for e in events if e[1] is not None), key=lambda e: e[1]):
            worker_event(span, name, at_s=at)
    end_worker_span(
        span,
        finished,
        end_s=timings.finished if timings is not None else None,
        **{"shoal.prefill_s": finished.prefill_s, "shoal.decode_s": finished.decode_s},
    )
