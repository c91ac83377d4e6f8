"""Prometheus metrics at GET /metrics on every router, under vLLM's names
with a `shoal:` prefix, labelled by model and worker.

Two kinds of series:
- measured here, per request, where clients feel them: latency and token
  histograms, token and success counters. Each router counts its own
  requests; a dashboard sums them over routers.
- read from the workers at scrape time (WorkerLoad): running, waiting, KV
  blocks, preemptions and prefix-cache lookups. Every router reports the
  same figures for a worker, so a dashboard takes `max by (worker)`.
And one of the router itself: its event loop's lag (loop_monitor.py).

Each router owns a registry of its own (not prometheus_client's global
one), so several fronts can live in one process, as they do in tests.
Nothing here grows without bound: a worker's per-request series go when
the worker leaves (forget_worker, called from the request router's
registry, routing/replica_stats.py), and the status page's TTFT window is
pruned on every insert.
"""

from __future__ import annotations

import math
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from shoal.proto.messages import RequestFinished, WorkerLoad
from shoal.proto.stats import KV_LOAD_BUCKETS_S
from shoal.router.routing import replica_stats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "worker")

# vLLM's buckets, so that dashboards made for it read these the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# Every series name /metrics exposes (counters with their _total).
METRIC_NAMES = (
    "shoal:num_requests_running",
    "shoal:num_requests_waiting",
    "shoal:kv_cache_usage_perc",
    "shoal:num_free_kv_blocks",
    "shoal:num_preemptions_total",
    "shoal:prefix_cache_queries_total",
    "shoal:prefix_cache_hits_total",
    "shoal:prompt_tokens_total",
    "shoal:generation_tokens_total",
    "shoal:request_success_total",
    "shoal:time_to_first_token_seconds",
    "shoal:inter_token_latency_seconds",
    "shoal:e2e_request_latency_seconds",
    "shoal:request_queue_time_seconds",
    "shoal:request_prompt_tokens",
    "shoal:request_generation_tokens",
    "shoal:router_event_loop_lag_seconds",
    # with KV tiers (--kv-offload-*); the kv_offload_ ones labelled `tier` too
    "shoal:external_prefix_cache_queries_total",
    "shoal:external_prefix_cache_hits_total",
    "shoal:kv_offload_load_bytes_total",
    "shoal:kv_offload_store_bytes_total",
    "shoal:kv_offload_evicted_blocks_total",
    "shoal:kv_offload_failed_blocks_total",
    "shoal:kv_offload_usage_perc",
)


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_len:
                return tuple(out)
            out.append(v)
        exp += 1


class _WorkerFigures:
    """A custom collector: the workers' loads as last read, as gauges and counters."""

    def __init__(self, model: str, max_loras: int = 0, include_lora_names: bool = False):
        self.model, self.max_loras = model, max_loras  # max_loras 0: LoRA off, no lora_requests_info
        # /metrics answers without the API key: adapter names only with --metrics-include-lora-names, else counts.
        self.include_lora_names = include_lora_names
        self.loads: list[WorkerLoad] = []

    def collect(self):
        def family(cls, name, doc):
            return cls(name, doc, labels=LABELS)

        running = family(GaugeMetricFamily, "shoal:num_requests_running", "Requests in the worker's running batch.")
        waiting = family(GaugeMetricFamily, "shoal:num_requests_waiting", "Requests waiting in the worker's queue.")
        usage = family(GaugeMetricFamily, "shoal:kv_cache_usage_perc", "KV-cache usage: 1 is full.")
        free = family(GaugeMetricFamily, "shoal:num_free_kv_blocks", "Free KV-cache blocks.")
        preempt = family(CounterMetricFamily, "shoal:num_preemptions", "Sequences preempted by the scheduler.")
        queries = family(
            CounterMetricFamily, "shoal:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        hits = family(CounterMetricFamily, "shoal:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # vLLM's vllm:lora_requests_info: the adapters in use as labels (their names, or how many), the value
        # the time they were read.
        lora = GaugeMetricFamily(
            "shoal:lora_requests_info",
            "Running stats on LoRA requests: the adapters of the running and the waiting requests.",
            labels=(*LABELS, "running_lora_adapters", "waiting_lora_adapters", "max_lora"),
        )
        tiers = _KVTierFamilies()
        for s in self.loads:
            lv = [self.model, s.worker]
            tiers.add(lv, s.kv_tiers)
            running.add_metric(lv, s.num_running)
            waiting.add_metric(lv, s.num_waiting)
            usage.add_metric(lv, 1.0 - s.num_free_blocks / s.num_total_blocks if s.num_total_blocks else 0.0)
            free.add_metric(lv, s.num_free_blocks)
            preempt.add_metric(lv, s.num_preemptions)
            queries.add_metric(lv, s.prefix_cache_queries)
            hits.add_metric(lv, s.prefix_cache_hits)
            if self.max_loras:
                run, wait = s.running_lora_adapters, s.waiting_lora_adapters
                shown = [",".join(run), ",".join(wait)] if self.include_lora_names else [str(len(run)), str(len(wait))]
                lora.add_metric(lv + [*shown, str(self.max_loras)], s.time)
        return [
            running,
            waiting,
            usage,
            free,
            preempt,
            queries,
            hits,
            *tiers.families(),
            *([lora] if self.max_loras else []),
        ]


class _KVTierFamilies:
    """The KV tiers' series (vLLM's external_prefix_cache_* and kv_offload_* names): none without tiers."""

    def __init__(self):
        def family(cls, name, doc, labels=LABELS):
            return cls(name, doc, labels=labels)

        tier = (*LABELS, "tier")
        self.queries = family(
            CounterMetricFamily,
            "shoal:external_prefix_cache_queries",
            "Prompt tokens past the device's prefix hits, looked up in the KV tiers.",
        )
        self.hits = family(
            CounterMetricFamily, "shoal:external_prefix_cache_hits", "Of those, tokens found in a KV tier."
        )
        self.load = family(
            CounterMetricFamily, "shoal:kv_offload_load_bytes", "Bytes loaded from the tier into the KV cache.", tier
        )
        self.store = family(CounterMetricFamily, "shoal:kv_offload_store_bytes", "Bytes saved to the tier.", tier)
        self.evicted = family(
            CounterMetricFamily, "shoal:kv_offload_evicted_blocks", "Blocks the tier dropped to make room.", tier
        )
        self.failed = family(
            CounterMetricFamily,
            "shoal:kv_offload_failed_blocks",
            "Blocks whose load from the tier failed (missing, or a bad checksum): computed instead.",
            tier,
        )
        self.usage = family(GaugeMetricFamily, "shoal:kv_offload_usage_perc", "The tier's usage: 1 is full.", tier)
        self.load_time = family(
            HistogramMetricFamily,
            "shoal:kv_offload_load_seconds",
            "Time each load from the tier took: one request's blocks (the cluster tier's: its fetch).",
            tier,
        )
        self.any = False

    def add(self, lv: list[str], kv_tiers: dict[str, dict]) -> None:
        if not kv_tiers:
            return
        self.any = True
        # Every tier is asked about the same tokens: past the device's hits.
        self.queries.add_metric(lv, max(t["query_tokens"] for t in kv_tiers.values()))
        self.hits.add_metric(lv, sum(t["hit_tokens"] for t in kv_tiers.values()))
        for name, t in sorted(kv_tiers.items()):
            tv = [*lv, name]
            self.load.add_metric(tv, t["loaded_blocks"] * t["bytes_per_block"])
            self.store.add_metric(tv, t["saved_blocks"] * t["bytes_per_block"])
            self.evicted.add_metric(tv, t["evicted_blocks"])
            self.failed.add_metric(tv, t["failed_blocks"])
            self.usage.add_metric(tv, t["used_blocks"] / t["total_blocks"] if t["total_blocks"] else 0.0)
            counts = t.get("load_buckets") or [0] * (len(KV_LOAD_BUCKETS_S) + 1)
            cumulative, buckets = 0, []
            for le, n in zip((*map(str, KV_LOAD_BUCKETS_S), "+Inf"), counts, strict=False):
                cumulative += n
                buckets.append((le, cumulative))
            self.load_time.add_metric(tv, buckets, t.get("load_us", 0) / 1e6)

    def families(self) -> list:
        if not self.any:
            return []
        return [self.queries, self.hits, self.load, self.store, self.evicted, self.failed, self.usage, self.load_time]


class RouterMetrics:
    """This router's series. `finished()` takes one request's figures once
    it ends; `render(loads)` is the /metrics body."""

    # The status page's TTFT percentiles are over the first tokens of the last WINDOW_S,
    # at most MAX_FIRSTS of them (the latest): past ~1,000 first tokens a second the window is shorter.
    WINDOW_S = 10.0
    MAX_FIRSTS = 10_000
    # A request that finishes on a worker after it left (draining) brings its series back for this long.
    LATE_S = 60.0

    def __init__(self, model: str, max_model_len: int, max_loras: int = 0, include_lora_names: bool = False):
        self.model = model
        r = self.registry = CollectorRegistry(auto_describe=False)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = Counter("shoal:prompt_tokens", "Prompt tokens of finished requests.", LABELS, registry=r)
        self.generation_tokens = Counter(
            "shoal:generation_tokens", "Tokens generated for finished requests.", LABELS, registry=r
        )
        self.success = Counter(
            "shoal:request_success", "Requests finished, by finish reason.", (*LABELS, "finished_reason"), registry=r
        )
        self.ttft = Histogram(
            "shoal:time_to_first_token_seconds",
            "Arrival at the router to the first token.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shoal:inter_token_latency_seconds",
            "Time between a request's tokens at the router.",
            LABELS,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shoal:e2e_request_latency_seconds",
            "Arrival at the router to the last token.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "shoal:request_queue_time_seconds",
            "Time waiting in the worker before first scheduled.",
            LABELS,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_hist = Histogram(
            "shoal:request_prompt_tokens", "Prompt tokens per request.", LABELS, buckets=tokens, registry=r
        )
        self.generation_hist = Histogram(
            "shoal:request_generation_tokens", "Generated tokens per request.", LABELS, buckets=tokens, registry=r
        )
        self._workers = _WorkerFigures(model, max_loras, include_lora_names)
        r.register(self._workers)
        # This router's own: how late its event loop runs (observability/loop_monitor.py; 0 unwatched).
        self.loop_lag = Gauge(
            "shoal:router_event_loop_lag_seconds",
            "The router's event-loop lag: the largest delay of its periodic wake-ups in about the last minute.",
            ("model_name",),
            registry=r,
        ).labels(model)
        # (monotonic time of a first token, its TTFT), oldest first
        self._firsts: deque[tuple[float, float]] = deque(maxlen=self.MAX_FIRSTS)
        self._reasons: set[str] = set()  # finish reasons seen: a worker's series go by (worker, reason)
        self._late: dict[str, float] = {}  # worker gone before its last requests here finished -> when seen
        # The process's request router drops a worker when Serve says it left: its series go with it.
        replica_stats.REGISTRY.on_departure(self.forget_worker)

    def finished(self, f: RequestFinished, gaps: list[float]) -> None:
        """One request ended: `f` from its last delta (with the router's
        TTFT and total), `gaps` its inter-token latencies seen here."""
        lv = (self.model, f.worker)
        if self._late or replica_stats.REGISTRY.departed(f.worker):
            self._sweep(f.worker)
        self.prompt_tokens.labels(*lv).inc(f.num_prompt_tokens)
        self.generation_tokens.labels(*lv).inc(f.num_output_tokens)
        self._reasons.add(f.finish_reason)
        self.success.labels(*lv, f.finish_reason).inc()
        if f.num_output_tokens:
            self.ttft.labels(*lv).observe(f.time_to_first_token_s)
        itl = self.itl.labels(*lv)
        for g in gaps:
            itl.observe(g)
        self.e2e.labels(*lv).observe(f.total_s)
        self.queue.labels(*lv).observe(f.queue_s)
        self.prompt_hist.labels(*lv).observe(f.num_prompt_tokens)
        self.generation_hist.labels(*lv).observe(f.num_output_tokens)

    def first_token(self, ttft_s: float) -> None:
        """A request's first token reached the router (for the status page).
        The window is pruned here, not only when the page reads it: nobody may."""
        now = time.monotonic()
        self._firsts.append((now, ttft_s))
        self._prune(now)

    def _prune(self, now: float) -> None:
        cutoff, firsts = now - self.WINDOW_S, self._firsts
        while firsts and firsts[0][0] < cutoff:
            firsts.popleft()

    def _sweep(self, worker: str) -> None:
        """Count `worker` as late if it left; forget the late ones not seen for LATE_S."""
        now = time.monotonic()
        if replica_stats.REGISTRY.departed(worker):
            self._late[worker] = now
        for w, at in list(self._late.items()):
            if now - at > self.LATE_S:
                del self._late[w]
                self.forget_worker(w)

    def forget_worker(self, worker: str) -> None:
        """The worker left (stopped, replaced, dead): its labelled series go,
        so a cluster that replaces workers for months does not pile them up."""
        lv = (self.model, worker)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.prompt_hist,
            self.generation_hist,
        ):
            metric.remove(*lv)
        for reason in list(self._reasons):
            self.success.remove(*lv, reason)

    def watch_loop(self, monitor) -> None:
        """The lag gauge reads `monitor` (a LoopMonitor) at each scrape."""
        self.loop_lag.set_function(monitor.lag_s)

    def render(self, loads: list[WorkerLoad]) -> bytes:
        if self._late:
            self._sweep("")
        self._workers.loads = loads
        return generate_latest(self.registry)

    def recent_ttft(self) -> tuple[float | None, float | None]:
        """(p50, p99) TTFT of the first tokens of the last WINDOW_S, or Nones."""
        self._prune(time.monotonic())
        xs = sorted(t for _, t in self._firsts)
        if not xs:
            return None, None
        return _quantile(xs, 0.5), _quantile(xs, 0.99)


def _quantile(xs: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted xs."""
    return xs[max(0, math.ceil(q * len(xs)) - 1)]
