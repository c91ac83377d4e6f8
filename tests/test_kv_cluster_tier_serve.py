"""Slow tier: the cluster KV tier in a real local Ray cluster (two workers on
the tiny model, --routing round-robin, --kv-cluster-tier object-store). A
conversation's turns alternate between the workers; each turn after the
first finds the earlier turns' blocks, computed on the other worker, in
Ray's object store, and the replies are those one engine without tiers
gives. A worker killed mid-stream leaves its blocks behind (the KVStore
deployment owns them): the stream resumed on the other worker loads them,
and computes only what was not yet published."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time

import grpc
import httpx
import pytest
from serving import local_cluster_app
from test_failover_cluster import kill_process, load, wait_for_workers

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc
from shoal.workers import LLM, SamplingParams
from shoal.workers.kv_transfer.cluster_tier import STORE_DEPLOYMENT

pytestmark = pytest.mark.slow
APP = "shoal-kv-cluster"
TURNS = [
    "You are a careful assistant. Answer briefly and keep to the facts given in the conversation so far.",
    " Now list three colours, one per line.",
    " And three animals, one per line, after them.",
]
MAX_TOKENS = 24


class Cluster:
    """The module's cluster; restart() stops it and starts it again with the same options (disk path included)."""

    def __init__(self, model: str, disk: str):
        self.options = dict(
            model=model,
            num_workers=2,
            num_threads=1,
            num_kv_blocks=256,
            routing="round-robin",
            kv_cluster_tier="object-store",
            kv_cluster_bytes=64 << 20,
            kv_offload_disk_path=disk,
            enable_kv_cache_events=True,
        )
        self.stack = contextlib.ExitStack()

    def start(self) -> tuple[str, str]:
        self.base, self.addr = self.stack.enter_context(local_cluster_app(APP, **self.options))
        wait_for_workers(self.addr, 2, 120)
        return self.base, self.addr

    def restart(self) -> tuple[str, str]:
        self.stack.close()  # Serve stops the workers gracefully: their disk writes are done
        return self.start()


@pytest.fixture(scope="module")
def restartable(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("kv-disk")))
    try:
        c.start()
        yield c
    finally:
        c.stack.close()


@pytest.fixture
def cluster(restartable):
    return restartable.base, restartable.addr


def _complete(client: httpx.Client, prompt: str) -> tuple[str, int]:
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _settled(read, done, timeout_s: float = 30.0):
    """read() until done(value) (the router polls the workers' figures: they reach /metrics a
    poll later), or the deadline; the last value."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    return value


def _cluster_loads(client: httpx.Client) -> dict[str, float]:
    """Bytes each worker loaded from the cluster tier."""
    text = client.get("/metrics").text
    series = re.findall(r'^shoal:kv_offload_load_bytes_total\{([^}]*tier="cluster"[^}]*)\} (\S+)$', text, re.M)
    return {re.search(r'worker="([^"]*)"', labels).group(1): float(v) for labels, v in series}


def _worker_names(client: httpx.Client) -> set[str]:
    return set(re.findall(r'^shoal:num_requests_running\{[^}]*worker="([^"]+)"', client.get("/metrics").text, re.M))


def test_a_router_subscribes_to_each_workers_kv_events(cluster):
    """Worker.kv_events through Serve, as a router calls it: a Subscribe
    naming the replica reaches that one, and its stream brings the blocks
    each request stored there, named by the router's chain keys."""
    from ray import serve

    from shoal.proto.kv_events import BlockStored
    from shoal.proto.messages import Subscribe

    base, _ = cluster
    with httpx.Client(base_url=base, timeout=120) as client:
        for i in range(2):  # round-robin: one on each worker
            _complete(client, f"Request {i}: " + "a long enough prompt to fill a block or two " * 4)
        names = _settled(lambda: _worker_names(client), lambda v: len(v) == 2)
    assert len(names) == 2
    handle = serve.get_deployment_handle("Worker", app_name=APP)
    for name in names:
        stream = handle.options(stream=True).kv_events.remote(Subscribe("test", name), 0)
        batches = next(iter(stream))  # what it holds from its start: the requests' blocks at least
        stream.cancel()
        stored = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "device"]
        assert stored and all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))


def test_round_robin_turns_load_the_other_workers_blocks_with_one_engines_replies(cluster, tiny_model):
    base, _ = cluster
    replies, cached, prompt = [], [], ""
    with httpx.Client(base_url=base, timeout=120) as client:
        for turn in TURNS:
            prompt += turn
            text, hit = _complete(client, prompt)
            replies.append(text)
            cached.append(hit)
            prompt += text
        loaded = _settled(lambda: sum(_cluster_loads(client).values()), lambda v: v > 0)
    # Turn 2 ran on the worker that had not seen the conversation: its hits came from the cluster tier.
    # (A reply's text, tokenized again, need not give its tokens: the hits end where they differ.)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] >= cached[1], cached
    assert loaded > 0
    with LLM(model=tiny_model, num_kv_blocks=256, num_threads=1) as llm:
        reference, prompt = [], ""
        for turn in TURNS:
            prompt += turn
            (out,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
            reference.append(out.text)
            prompt += out.text
    assert replies == reference


def _stream(addr: str, prompt: str, on_token=None) -> list[int]:
    """A greedy gRPC stream's token ids; on_token(ids so far) after each message."""
    sampling = pb.SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    with grpc.insecure_channel(addr) as ch:
        for m in pb_grpc.ShoalStub(ch).Generate(pb.GenerateRequest(text=prompt, sampling=sampling), timeout=300):
            tokens += m.token_ids
            if on_token is not None:
                on_token(tokens)
    return tokens


STREAM_TOKENS = 900  # the tiny model's 1,024 positions, less the prompt


def _block_bytes(model: str) -> int:
    """A KV block of the tiny model (float32): keys and values of every layer."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * head_dim * 4


def test_a_stream_resumed_after_its_worker_died_loads_what_that_worker_published(cluster, tiny_model):
    base, addr = cluster
    prompt = "Count slowly, one number a line, and never stop:"  # new to both workers: no device hits
    with LLM(model=tiny_model, num_kv_blocks=256, num_threads=1) as llm:
        params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
        reference = llm.generate([prompt], params)[0].token_ids
    from ray import serve

    state: dict = {}
    store = serve.get_deployment_handle(STORE_DEPLOYMENT, APP)

    def stored() -> int:
        return store.stats.remote().result(timeout_s=30)["stored_blocks"]

    def kill_midway(tokens: list[int]) -> None:
        if "victim" not in state and len(tokens) >= 300:
            state["victim"] = next(w.worker for w in load(addr) if w.num_running)
            state["streamed"] = len(tokens)
            kill_process(state["victim"], APP)
            # What the store held of the stream once the worker was dead (its publishes run behind its
            # steps, by however long this machine takes): read before the resumed stream publishes any.
            state["published"] = stored() - state["stored_before"]

    state["stored_before"] = stored()

    prompt_tokens = httpx.post(f"{base}/tokenize", json={"prompt": prompt}).json()["count"]
    with httpx.Client(base_url=base, timeout=60) as client:
        before = _cluster_loads(client)
        got = _stream(addr, prompt, kill_midway)
        assert got == reference and "victim" in state
        # Every block the dead worker had published (the prompt's at least) came from the cluster tier.
        want = state["published"]
        assert want >= prompt_tokens // 16, state

        def survivors_blocks() -> float:
            after = _cluster_loads(client)
            gained = [v - before.get(w, 0.0) for w, v in after.items() if w != state["victim"]]
            return max(gained, default=0.0) / _block_bytes(tiny_model)

        loaded_blocks = _settled(survivors_blocks, lambda v: v >= want)
    assert loaded_blocks >= want, (loaded_blocks, want, state)
    wait_for_workers(addr, 2, 180, gone=state["victim"])  # Serve replaced it: the other tests see two


def _tier_loads(client: httpx.Client, tier: str) -> float:
    text = client.get("/metrics").text
    series = re.findall(rf'^shoal:kv_offload_load_bytes_total\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)$', text, re.M)
    return sum(float(v) for v in series)


def test_after_a_restart_an_old_conversation_hits_on_disk(restartable):
    """Last in the module: it restarts the cluster."""
    prompt = "An old conversation, kept on disk by whichever worker served it. Go on:"
    with httpx.Client(base_url=restartable.base, timeout=120) as client:
        text, _ = _complete(client, prompt)
    base, _ = restartable.restart()
    with httpx.Client(base_url=base, timeout=120) as client:
        _, cached = _complete(client, prompt + text + " And then?")
        loaded = _settled(lambda: _tier_loads(client, "disk"), lambda v: v > 0)
    # The first request after the restart: its pool and the cluster tier are empty, the disk is not.
    assert cached > 0 and loaded > 0, (cached, loaded)
