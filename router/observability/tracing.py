"""The router's spans: one SERVER span per request, named and attributed
per the OpenTelemetry GenAI semantic conventions, with child spans for
validate+tokenize and routing, and a 'failed_over' event. Built on
shoal.proto.tracing (configure, inject, flush live there); every helper
takes None for a span and returns at once when tracing is off."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from shoal.proto import tracing as core
from shoal.proto.tracing import ENV_VARS, configure, end_span, fail_span, flush, inject, otel_env

__all__ = [
    "ENV_VARS",
    "configure",
    "context_from_headers",
    "context_from_metadata",
    "end_request_span",
    "end_span",
    "fail_request_span",
    "fail_span",
    "failed_over",
    "finish_request_span",
    "flush",
    "inject",
    "otel_env",
    "request_params",
    "route_span",
    "set_request_params",
    "stage_span",
    "start_request_span",
    "trace_route",
]

SYSTEM = "shoal"
OPERATIONS = ("chat", "text_completion")
# Request values -> their GenAI attribute (gen_ai.request.<name>).
_REQUEST = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stop_sequences",
)


# ---- the client's context --------------------------------------------------------


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The client's W3C context (traceparent, tracestate, baggage, as the
    global propagator reads them) from HTTP headers: a Starlette Headers or
    any mapping. An empty Context without them; None when tracing is off."""
    if not core.enabled:
        return None
    return propagate.extract({str(k).lower(): v for k, v in headers.items()})


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The same from gRPC invocation metadata ((key, value) pairs)."""
    if not core.enabled:
        return None
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}  # -bin values are bytes
    return propagate.extract(carrier)


# ---- the request's span ----------------------------------------------------------


def request_params(params) -> dict:
    """start_request_span's request keywords from a SamplingParams (or any
    object with its fields); values meaning 'off' are left out."""
    top_k = getattr(params, "top_k", None)
    return {
        "max_tokens": getattr(params, "max_tokens", None),
        "temperature": getattr(params, "temperature", None),
        "top_p": getattr(params, "top_p", None),
        "top_k": top_k if top_k is not None and top_k > 0 else None,
        "seed": getattr(params, "seed", None),
        "presence_penalty": getattr(params, "presence_penalty", None),
        "frequency_penalty": getattr(params, "frequency_penalty", None),
        "stop_sequences": list(getattr(params, "stop", None) or ()) or None,
    }


def set_request_params(span, **request) -> None:
    """gen_ai.request.* from keywords named in _REQUEST (None: left out)."""
    unknown = set(request) - set(_REQUEST)
    if unknown:
        raise TypeError(f"unknown request attribute(s): {sorted(unknown)}")
    core.set_attributes(span, {f"gen_ai.request.{k}": v for k, v in request.items()})


def start_request_span(
    parent_ctx: Context | None,
    operation: str,
    model: str,
    *,
    request_id: str | None = None,
    client_request_id: str | None = None,
    stream: bool | None = None,
    start_s: float | None = None,
    **request,
):
    """The request's SERVER span, `"{operation} {model}"`, a child of the
    client's context (a root when it sent none); None when tracing is off.
    operation: 'chat' or 'text_completion'. request: max_tokens,
    temperature, top_p, top_k, seed, presence_penalty, frequency_penalty,
    stop_sequences (see request_params); more can follow via set_request_params."""
    if not core.enabled:
        return None
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {OPERATIONS}, not {operation!r}")
    span = cast(trace.Tracer, core.tracer).start_span(
        f"{operation} {model}", context=parent_ctx, kind=SpanKind.SERVER, start_time=core.ns(start_s)
    )
    core.set_attributes(
        span,
        {
            "gen_ai.operation.name": operation,
            "gen_ai.system": SYSTEM,
            "gen_ai.provider.name": SYSTEM,
            "gen_ai.request.model": model,
            "gen_ai.response.id": request_id,
            "shoal.client_request_id": client_request_id,
            "shoal.stream": stream,
        },
    )
    set_request_params(span, **request)
    return span


def finish_request_span(
    span,
    finished=None,
    *,
    response_model: str | None = None,
    prefill_s: float | None = None,
    end_s: float | None = None,
    **attributes,
) -> None:
    """Set the response's attributes and end the span. `finished` is the
    last delta's RequestFinished (or anything with its fields, read by name:
    finish_reason, num_prompt_tokens, num_cached_tokens, num_output_tokens,
    queue_s, time_to_first_token_s, total_s, worker). prefill_s defaults to
    the router's view: time to first token less the worker's queue (so it
    includes the Ray hop); decode_s is the rest of the request."""
    if span is None or not span.is_recording():
        return
    f = finished
    reason = getattr(f, "finish_reason", None)
    queue, ttft, total = (getattr(f, k, None) for k in ("queue_s", "time_to_first_token_s", "total_s"))
    if prefill_s is None:
        prefill_s = getattr(f, "prefill_s", None)
    if prefill_s is None and ttft is not None and queue is not None:
        prefill_s = max(ttft - queue, 0.0)
    decode_s = max(total - ttft, 0.0) if total is not None and ttft is not None else None
    core.set_attributes(
        span,
        {
            "gen_ai.response.model": response_model,
            "gen_ai.response.finish_reasons": [str(reason)] if reason is not None else None,
            "gen_ai.usage.input_tokens": getattr(f, "num_prompt_tokens", None),
            "gen_ai.usage.output_tokens": getattr(f, "num_output_tokens", None),
            "shoal.cached_prompt_tokens": getattr(f, "num_cached_tokens", None),
            "shoal.worker": getattr(f, "worker", None),
            "shoal.queue_s": queue,
            "shoal.ttft_s": ttft,
            "shoal.prefill_s": prefill_s,
            "shoal.decode_s": decode_s,
            "shoal.e2e_s": total,
        },
    )
    core.set_attributes(span, attributes)
    span.end(end_time=core.ns(end_s))


def fail_request_span(span, error: BaseException | str, error_type: str | None = None) -> None:
    """Record the error (a ServingError's kind becomes error.type), status ERROR, end."""
    kind = getattr(error, "kind", None)
    fail_span(span, error, error_type or (kind if isinstance(kind, str) else None))


def end_request_span(span, cancelled: bool = False) -> None:
    """For a `finally`: end the span if finish/fail did not (the client went away)."""
    if span is not None and span.is_recording():
        if cancelled:
            span.set_attribute("shoal.cancelled", True)
        span.end()


# ---- child spans and events ------------------------------------------------------


def _parent_context(parent) -> Context | None:
    """A span, a Context, or an inject() carrier (GenerateRequest.trace_context)."""
    if parent is None or isinstance(parent, Context):
        return parent
    if isinstance(parent, Mapping):
        return core.extract(parent)
    return trace.set_span_in_context(parent)


@contextmanager
def stage_span(parent, name: str = "shoal.prepare", **attributes):
    """A child span around a stage of the request (validate + tokenize by
    default): yields it (None when off or without a parent); an exception
    leaving the block is recorded on it (status ERROR) and re-raised."""
    if not core.enabled or parent is None:
        yield None
        return
    span = cast(trace.Tracer, core.tracer).start_span(name, context=_parent_context(parent))
    core.set_attributes(span, attributes)
    try:
        yield span
    except BaseException as e:
        fail_request_span(span, e)
        raise
    finally:
        end_span(span)


def route_span(
    parent,
    candidates: list[dict],
    chosen: str | None,
    *,
    start_s: float | None = None,
    end_s: float | None = None,
    **attributes,
) -> None:
    """A finished child span for one routing decision. parent: the request's
    span, or its carrier (GenerateRequest.trace_context). candidates: one dict
    per replica with 'worker', 'free_blocks' and 'queue_depth' (and,
    optionally, 'running', 'cost', 'hit_blocks'); each key present in every
    dict becomes an array attribute, in the candidates' order."""
    if not core.enabled or parent is None:
        return
    attrs: dict[str, Any] = {"shoal.route.chosen": chosen, "shoal.route.num_candidates": len(candidates)}
    for key, attr, kind in (
        ("worker", "workers", str),
        ("free_blocks", "free_blocks", int),
        ("queue_depth", "queue_depths", int),
        ("running", "running", int),
        ("cost", "costs", float),
        ("hit_blocks", "hit_blocks", int),
    ):
        values: list[Any] = [c.get(key) for c in candidates]
        if candidates and all(v is not None for v in values):  # an array must be whole and of one type
            attrs[f"shoal.route.{attr}"] = [kind(v) for v in values]
    attrs.update(attributes)
    span = cast(trace.Tracer, core.tracer).start_span(
        "shoal.route", context=_parent_context(parent), start_time=core.ns(start_s)
    )
    core.set_attributes(span, attrs)
    span.end(end_time=core.ns(end_s))


def failed_over(
    span, from_worker: str, num_streamed_tokens: int, reason: str | None = None, at_s: float | None = None
) -> None:
    """The request left a lost worker for another, after streaming
    num_streamed_tokens: an event on the request's span, or, given its
    carrier (GenerateRequest.trace_context, where the span is out of reach),
    on a zero-length child span 'shoal.failed_over'."""
    if not core.enabled or span is None:
        return
    attrs = {"shoal.from_worker": from_worker, "shoal.streamed_tokens": num_streamed_tokens, "shoal.reason": reason}
    if isinstance(span, Mapping):
        t = core.ns(at_s) or time.time_ns()
        child = cast(trace.Tracer, core.tracer).start_span(
            "shoal.failed_over", context=core.extract(span), start_time=t
        )
        core.add_event(child, "failed_over", attrs, t / 1e9)
        child.end(end_time=t)
    else:
        core.add_event(span, "failed_over", attrs, at_s)


def trace_route(carrier, names: list[str], figs: Sequence[Any], chosen: int, policy: str) -> None:
    """route_span from the request router's view: each replica's name and
    figures (replica_stats.ReplicaFigures, None before its first report)."""
    rows = [
        {
            "worker": n,
            "free_blocks": f.free_blocks if f else 0,
            "queue_depth": f.waiting if f else 0,
            "running": f.running if f else 0,
        }
        for n, f in zip(names, figs)
    ]
    policy_attr: dict[str, Any] = {"shoal.route.policy": policy}
    route_span(carrier, rows, names[chosen], **policy_attr)
