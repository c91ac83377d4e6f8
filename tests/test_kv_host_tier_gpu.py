"""The host KV tier on a GPU (scripts/gpu_check.py runs it): pinned slots,
copies on a stream of their own, the tier written through after each
prefill, and the tokens of an engine without it."""

from __future__ import annotations

import tempfile

import pytest
import torch
from test_kv_host_tier import GREEDY, HOST_HITS, POOL_BLOCKS, WORKLOAD, _run
from tiny_models import make_tiny_model

from shoal.workers import LLMEngine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host tier beside a GPU's cache needs CUDA")
def test_host_tier_on_a_gpu_gives_the_tokens_of_no_tier():
    folder = tempfile.mkdtemp(prefix="host-tier-gpu-")  # no fixture: the GPU check may run it without pytest
    tiny_model = make_tiny_model(folder)

    def run(host_bytes: int):
        engine = LLMEngine(model=tiny_model, device="cuda", num_kv_blocks=POOL_BLOCKS, kv_offload_host_bytes=host_bytes)
        try:
            storage = engine.model_executor.driver_worker.runner.kv_connector.host_storage if host_bytes else None
            on_stream = storage is not None and storage.data.is_pinned() and storage.stream is not None
            return _run(engine, WORKLOAD, GREEDY), engine.kv_tier_stats(), on_stream
        finally:
            engine.shutdown()

    off, _, _ = run(0)
    on, tiers, on_stream = run(64 * 2 * 2 * 16 * 2 * 16 * 4)  # 64 blocks of the tiny model in float32
    assert on == off
    host = tiers["host"]
    assert host.hit_tokens == HOST_HITS and host.saved_blocks > 0
    assert on_stream  # pinned slots, copies on a stream of their own
