"""An engine's load figures: read by the worker, sent to routers. Here,
apart from the engine, so that the wire messages and the router never
import torch."""

from __future__ import annotations

from dataclasses import dataclass

# Upper bounds (seconds) of the buckets a KV tier's loads are counted in by the
# time each took (one request's blocks from one tier): WorkerLoad.kv_tiers'
# load_buckets, and the router's shoal:kv_offload_load_seconds histogram.
KV_LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(slots=True)
class EngineStats:
    """What a router needs to choose a worker, readable at any moment."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int  # of the engine's block size, which WorkerInfo carries
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_waiting_tokens: int  # prompt tokens still to prefill (Scheduler.num_waiting_tokens)
    # Counters since the engine started (metrics and the status page take rates of them).
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found cached
    num_prompt_tokens: int  # prompt tokens of the requests added
    num_generation_tokens: int  # tokens sampled
    num_finished_requests: int  # requests ended (stop, length or abort)
