"""Slow tier: a request that kills any worker it lands on (a fault injected
through SHOAL_FAULT_INJECTION, which the local cluster's workers inherit) is
sent to two workers at most; its client gets 500 poisoned_request, and the
cluster then serves normally once Serve has replaced the dead workers."""

from __future__ import annotations

import os

import httpx
import pytest
from serving import local_cluster_app
from test_failover_cluster import load, wait_for_workers

from shoal.workers.fault_injection import ENV

pytestmark = pytest.mark.slow
POISON = 509  # a token id of the tiny model's that only the poisoned prompt holds


@pytest.fixture(scope="module")
def cluster(tiny_model):
    old = os.environ.get(ENV)
    os.environ[ENV] = f"fatal={POISON}"  # the local Ray cluster's processes inherit it
    try:
        with local_cluster_app(
            "shoal-poison", model=tiny_model, num_workers=2, num_threads=1, num_kv_blocks=256, stall_timeout_s=5.0
        ) as (base, addr):
            wait_for_workers(addr, 2, 120)
            yield base, addr
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def test_a_request_that_kills_its_workers_reaches_two_at_most_and_the_cluster_recovers(cluster):
    base, addr = cluster
    before = {w.worker for w in load(addr)}
    body = {"prompt": [POISON, 30, 31, 32], "max_tokens": 4, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "poisoned_request" and "on 2 workers" in err["message"], err
    # Serve replaces both dead workers; then the cluster serves as before.
    after = wait_for_workers(addr, 2, 240)
    assert not before & {w.worker for w in after}  # both that held it died; no third was sent it
    ok = httpx.post(
        base + "/v1/completions",
        json={"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
