"""In-process router fronts over real Workers (no Ray), for the fast tier."""

from __future__ import annotations

from contextlib import asynccontextmanager, contextmanager

import httpx

from shoal.benchmarks.ports import free_port  # re-exported: the tests import it from here
from shoal.cluster.options import ServeOptions
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.observability.loop_monitor import LoopMonitor
from shoal.router.routing.worker_pool import LocalWorkerPool
from shoal.workers import EngineArgs
from shoal.workers.worker import Worker


def make_frontend(
    model: str, num_workers: int = 1, max_waiting: int = 64, api_key: str | None = None, **engine
) -> Frontend:
    engine.setdefault("num_kv_blocks", 256)
    workers = [Worker(EngineArgs(model=model, **engine), max_waiting=max_waiting) for _ in range(num_workers)]
    info = ModelInfo.from_worker_info(workers[0].info(), num_workers)
    return Frontend(LocalWorkerPool(workers), workers[0].engine.engine.tokenizer, info, api_key)


@contextmanager
def local_cluster_app(name: str, num_gpus: int = 0, **opts):
    """A local Ray cluster (4 logical CPUs, num_gpus logical GPUs) serving
    the application that ServeOptions `opts` build, on free ports; yields
    (HTTP base URL, gRPC address) and shuts Serve and Ray down after."""
    import ray
    from ray import serve

    from shoal.cluster.app import api_key_for_local_cluster, build_app

    # An api_key reaches the Router as `shoal serve` hands it over: in the environment the raylet inherits.
    with api_key_for_local_cluster(opts.get("api_key")):
        ray.init(num_cpus=4, num_gpus=num_gpus, include_dashboard=False, logging_level="WARNING")
        http, grpc_port = free_port(), free_port()
        try:
            serve.start(proxy_location="Disabled")
            serve.run(build_app(dict(opts, http_port=http, grpc_port=grpc_port)), name=name, route_prefix=None)
            yield f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}"
        finally:
            serve.shutdown()
            ray.shutdown()


@asynccontextmanager
async def http_client(fe: Frontend, **kw):
    kw.setdefault("max_request_bytes", ServeOptions().max_request_bytes)
    app = OpenAIApp(fe, **kw).app
    async with (
        _loop_monitor(fe),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shoal") as client,
    ):
        yield client


@asynccontextmanager
async def _loop_monitor(fe: Frontend):
    """The event-loop monitor a router runs (ingress.Router), on this loop while the front serves."""
    monitor = LoopMonitor()
    fe.metrics.watch_loop(monitor)
    monitor.start()
    try:
        yield monitor
    finally:
        monitor.stop()


@asynccontextmanager
async def grpc_server(fe: Frontend):
    server = GrpcServer(fe, "127.0.0.1", 0, ServeOptions().max_request_bytes)
    await server.start()
    try:
        async with _loop_monitor(fe):
            yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)
