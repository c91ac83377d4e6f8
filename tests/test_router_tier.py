"""Slow tier: the router tier. Two Ray nodes on this host, each carrying the
resource shoal_router; `--routers 2` puts one Router on each. Both bind the
same HTTP and gRPC ports (SO_REUSEPORT), both serve, and killing one loses
only its own streams: the other goes on serving."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from serving import free_port

from shoal.proto.v1 import shoal_pb2 as pb
from shoal.proto.v1 import shoal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
APP = "shoal-routers"
# What a client sees when its connection hit a router the moment it died.
CONNECTION_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@pytest.fixture(scope="module")
def routers(tiny_model):
    """(the Router deployment's handle, HTTP base URL, gRPC address) of an
    app with two routers and one worker on a two-node cluster."""
    import ray
    import ray._common.utils
    import ray._private.utils
    from ray import serve
    from ray.cluster_utils import Cluster

    from shoal.cluster.app import build_app, router_deployment_options
    from shoal.cluster.options import ServeOptions

    with pytest.MonkeyPatch.context() as mp:
        # Cluster records its address in /tmp/ray/ray_current_cluster (and
        # deletes that file after), where a plain ray.init() of another
        # process on this host would find it: keep the file as it is.
        mp.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        mp.setattr(ray._common.utils, "reset_ray_address", lambda *a, **k: None)
        node = dict(resources={"shoal_router": 1}, object_store_memory=100 << 20)
        cluster = Cluster(initialize_head=True, head_node_args=dict(node, num_cpus=1, include_dashboard=False))
        try:
            cluster.add_node(**node, num_cpus=1)
            ray.init(address=cluster.address, logging_level="WARNING")
            http, grpc_port = free_port(), free_port()
            opts = dict(
                model=tiny_model,
                routers=2,
                num_workers=1,
                cpus_per_worker=0.5,
                num_threads=1,
                num_kv_blocks=256,
                device="cpu",
                http_port=http,
                grpc_port=grpc_port,
                drain_timeout_s=2.0,
            )
            assert router_deployment_options(ServeOptions.from_dict(opts))["ray_actor_options"]["resources"] == {
                "shoal_router": 0.01
            }
            serve.start(proxy_location="Disabled")
            handle = serve.run(build_app(opts), name=APP, route_prefix=None)
            yield handle, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}"
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                cluster.shutdown()


def complete(base: str, prompt: str = "The quick brown fox", max_tokens: int = 4) -> httpx.Response:
    """One completion over a connection of its own."""
    # ignore_eos: a sampled reply of the random tiny model may draw its EOS and end short.
    return httpx.post(
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        timeout=60,
        headers={"Connection": "close"},
    )


def generate(addr: str, prompt: str = "Paged attention keeps") -> list:
    """One gRPC Generate over a channel (and so a TCP connection) of its own."""
    with grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
        return list(pb_grpc.ShoalStub(ch).Generate(req, timeout=60))


def listening_ports(pid: int) -> set[int]:
    import psutil

    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_two_routers_on_two_nodes_share_the_ports_and_both_serve(routers):
    from ray import serve

    from shoal.cluster.serve_cmd import router_endpoints

    handle, base, addr = routers
    ends = router_endpoints(handle)
    assert serve.status().applications[APP].deployments["Router"].replica_states == {"RUNNING": 2}
    assert len({e["node_id"] for e in ends}) == 2 and len({e["pid"] for e in ends}) == 2  # one per node
    http_port, grpc_port = int(base.rsplit(":", 1)[1]), int(addr.rsplit(":", 1)[1])
    for e in ends:  # both processes listen on both ports
        assert {http_port, grpc_port} <= listening_ports(e["pid"]), e
    served_by = []
    for _ in range(24):
        r = complete(base, max_tokens=2)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        served_by.append(r.headers["x-shoal-router"])
    # The kernel spreads fresh connections over both (all 24 on one: 2^-23).
    assert set(served_by) == {e["router"] for e in ends}, served_by
    for _ in range(12):
        msgs = generate(addr)
        assert msgs[-1].HasField("finished") and msgs[-1].finished.usage.completion_tokens == 4


STREAM_S = 20.0  # a long stream lasts at least about this long
MAX_TOKENS = 960  # the tiny model's 1,024 positions, less the prompt


def stream_tokens(base: str) -> int:
    """Tokens a stream needs to last STREAM_S here, from the pace of two
    measured completions (their difference leaves out the fixed cost)."""
    took = []
    for n in (8, 72):
        t0 = time.monotonic()
        assert complete(base, max_tokens=n).status_code == 200
        took.append(time.monotonic() - t0)
    per_token = max(took[1] - took[0], 1e-3) / 64
    return max(100, min(MAX_TOKENS, math.ceil(STREAM_S / per_token)))


def open_stream(base: str, max_tokens: int):
    """A long streamed completion on a connection of its own; returns
    (client, response, the router serving it) once its first event is in."""
    client = httpx.Client(timeout=60)
    body = {"prompt": "Continuous batching rebuilds", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    resp = client.send(client.build_request("POST", base + "/v1/completions", json=body), stream=True)
    lines = resp.iter_lines()
    assert resp.status_code == 200 and next(ln for ln in lines if ln).startswith("data: ")
    return client, resp, lines


def test_killing_one_router_loses_only_its_streams_and_the_other_keeps_serving(routers):
    from shoal.cluster.serve_cmd import router_endpoints

    handle, base, addr = routers
    ends = {e["router"]: e for e in router_endpoints(handle)}
    # One long stream on each router, still running at the kill on any machine.
    max_tokens = stream_tokens(base)
    streams = {}
    while len(streams) < 2:
        client, resp, lines = open_stream(base, max_tokens)
        name = resp.headers["x-shoal-router"]
        if name in streams:  # that router has one already
            resp.close()
            client.close()
        else:
            streams[name] = (client, resp, lines)
    victim, survivor = sorted(streams)
    # Traffic on fresh connections all along; a connection the kill catches is retried.
    retried, served, done, failures = [], [], threading.Event(), []

    def traffic():
        try:
            while not done.is_set():
                for _ in range(5):
                    try:
                        r = complete(base, max_tokens=2)
                        break
                    except CONNECTION_ERRORS as e:
                        retried.append(repr(e))
                else:
                    raise AssertionError("5 connection errors in a row")
                assert r.status_code == 200, r.text
                served.append(r.headers["x-shoal-router"])
        except Exception as e:
            failures.append(repr(e))

    t = threading.Thread(target=traffic)
    t.start()
    os.kill(ends[victim]["pid"], signal.SIGKILL)
    try:
        # The victim's stream is cut; the survivor's runs to its end.
        with pytest.raises(CONNECTION_ERRORS):
            for _ in streams[victim][2]:
                pass
        rest = [ln for ln in streams[survivor][2] if ln]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        # The traffic goes on after both streams' ends: a few more requests served (or a failure).
        n, deadline = len(served), time.monotonic() + 60
        while len(served) < n + 5 and not failures and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        t.join(120)
        for client, resp, _ in streams.values():
            resp.close()
            client.close()
    assert not failures, failures
    assert len(retried) <= 3, retried
    # From now on every request is served at once, never by the dead router
    # (Serve may have started its replacement on that node by now).
    served_by = set()
    for _ in range(20):
        r = complete(base, max_tokens=2)
        assert r.status_code == 200
        served_by.add(r.headers["x-shoal-router"])
    for _ in range(10):
        assert generate(addr)[-1].finished.usage.completion_tokens == 4
    assert victim not in served_by and survivor in served_by, served_by
