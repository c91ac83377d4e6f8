"""The router replica: serves OpenAI HTTP and gRPC itself and streams from
the workers through a Serve handle.

Clients connect to this process directly rather than through Ray Serve's
proxies: Serve's gRPC proxy cannot carry server reflection (a bidirectional
stream) or the standard health service, and skipping the proxy takes one Ray
hop off every token. See docs/architecture.md, Processes and placement.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from shoal.proto import replica_logs
from shoal.proto.lora.registry import serve_app_registry
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.router.fronts.http_connections import ConnectionLimits, connection_cap, protocol_class, raise_file_limit
from shoal.router.fronts.http_guards import host_allowlist
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.fronts.tls import TLSFiles
from shoal.router.observability import tracing
from shoal.router.observability.loop_monitor import LoopMonitor
from shoal.router.observability.status_page import StatusPage
from shoal.router.options import RouterOptions
from shoal.router.routing.failover import FailoverPool
from shoal.router.routing.worker_pool import ServeWorkerPool

logger = logging.getLogger(__name__)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT: the routers on one
    host share the port, the kernel spreading new connections over them (and
    over the survivors when one dies). A process that binds the port without
    SO_REUSEPORT still conflicts with it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {e.strerror}") from None
    return sock


async def start_http(
    app,
    host: str,
    port: int,
    headers: list[tuple[str, str]] | None = None,
    limits: ConnectionLimits | None = None,
    tls: TLSFiles | None = None,
):
    """Run uvicorn on this event loop, on a port shared with the host's other
    routers; every response carries `headers`. Return (server, its task) once it listens.
    `limits` bound each connection's idle wait and header time and how many are open
    (http_connections.py); `tls`: HTTPS. The app answers 429 past --max-concurrent-requests
    (http_guards.AdmissionLimit). uvicorn's limit_concurrency stays off: it counts idle
    connections too, so a crowd of them would turn every request away with 503."""
    import uvicorn

    limits = limits or ConnectionLimits()
    cap = connection_cap(limits.max_connections)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
        headers=headers,
        http=protocol_class(limits.header_timeout_s, cap),
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # annotated int; a float works
        **(tls.uvicorn_settings() if tls else {}),
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[reuse_port_socket(host, port)]))
    while not server.started:
        if task.done():  # bind failed: uvicorn logs it and exits
            raise OSError(f"cannot listen for HTTP on {host}:{port}")
        await asyncio.sleep(0.02)
    return server, task


def replica_name() -> str:
    """This router's Serve replica id (the X-Shoal-Router header)."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a Serve replica
        return f"pid-{os.getpid()}"


class Router:
    """One replica in front of the Worker deployment's handle. Several may
    run (--routers), one per node; each routes on its own."""

    async def __init__(self, workers, options: RouterOptions):  # type: ignore[misc]  # Serve awaits it
        from shoal.proto.tokenizer import load_tokenizer

        self.options = options
        replica_logs.use_serve_handlers()  # failovers, rebalancing, delta streams
        self.name = replica_name()
        tracing.configure("shoal-router")  # on only when OTEL_* asks for it
        # A stream whose worker is lost goes on on another one.
        pool = FailoverPool(ServeWorkerPool(workers, self.name, options.max_stream_buffer_tokens), options.max_retries)
        info = await pool.info()
        # The tokenizer comes from the model file; the weights stay unread here.
        tokenizer = load_tokenizer(options.model)
        self.frontend = Frontend(
            pool,
            tokenizer,
            ModelInfo.from_worker_info(info, options.num_workers),
            options.resolved_api_key(),
            options.max_prompts,
            options.tokenizer_threads,
            options.allow_runtime_lora_updating,
            serve_app_registry(),
            cache_isolation=options.cache_isolation,
            max_concurrent_requests=options.max_concurrent_requests,
            max_tokens_per_request=options.max_tokens_per_request,
            lora_root=options.lora_root,
            max_runtime_loras=options.max_runtime_loras,
            metrics_include_lora_names=options.metrics_include_lora_names,
        )
        # The event loop's lag (a gauge) and whatever holds it past 0.1 s (a warning naming the request).
        self.loop_monitor = LoopMonitor()
        self.frontend.metrics.watch_loop(self.loop_monitor)
        self.loop_monitor.start()
        if options.allow_runtime_lora_updating and self.frontend.api_key is None:
            logger.warning(
                "--allow-runtime-lora-updating without an API key: any client that reaches this router "
                "can make the workers read adapter files from paths it names"
            )
        if options.allow_runtime_lora_updating and not options.lora_root:
            logger.warning(
                "--allow-runtime-lora-updating without --lora-root: runtime loads may read adapters from any "
                "path the workers can read; set --lora-root to the folder adapters are kept in"
            )
        limit, concurrent = options.max_request_bytes, options.max_concurrent_requests
        raise_file_limit()  # before the connection cap is derived from it
        self.tls = TLSFiles.from_options(options)
        conns = ConnectionLimits(
            options.http_header_timeout_s,
            options.http_keep_alive_timeout_s,
            connection_cap(options.max_connections),
        )
        self.grpc = GrpcServer(
            self.frontend,
            options.host,
            options.grpc_port,
            limit,
            concurrent,
            options.allow_client_priority,
            options.tool_call_parser,
            max_connections=conns.max_connections,
            handshake_timeout_s=conns.header_timeout_s,
            tls=self.tls,
        )
        await self.grpc.start()
        try:
            app = OpenAIApp(
                self.frontend,
                limit,
                StatusPage(self.frontend, self.name, options.routing),
                concurrent,
                host_allowlist(options.allowed_hosts, self.frontend.api_key),
                options.tool_call_parser,
                body_timeout_s=options.http_body_timeout_s,
            ).app
            self.http, self._http_task = await start_http(
                app, options.host, options.http_port, [("X-Shoal-Router", self.name)], conns, self.tls
            )
        except BaseException:
            await self.grpc.stop()
            raise
        self._stopped = False

    def endpoints(self) -> dict:
        import ray

        o = self.options
        return {
            "http": f"{'https' if self.tls else 'http'}://{o.host}:{o.http_port}",
            "grpc": f"{o.host}:{self.grpc.port}",
            "model": self.frontend.info.model,
            "router": self.name,
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def check_health(self) -> None:
        if self._http_task.done() and not self._stopped:
            raise RuntimeError("the HTTP server stopped")

    async def drain(self, timeout_s: float | None = None) -> int:
        """New requests get 503 / UNAVAILABLE; streams in flight get up to
        timeout_s to finish; then both servers close. Returns how many were cut."""
        if self._stopped:
            return 0
        timeout_s = self.options.drain_timeout_s if timeout_s is None else timeout_s
        await self.grpc.set_serving(False)
        left = await self.frontend.drain(timeout_s)
        self._stopped = True
        self.http.should_exit = True
        await self.grpc.stop(0.5)
        try:
            await asyncio.wait_for(self._http_task, 5.0)
        except Exception:
            pass
        self.loop_monitor.stop()
        if left:
            logger.warning("shutdown: %d streams were still running after %.0f s", left, timeout_s)
        return left

    async def __del__(self):
        # Serve calls this when it stops the replica (e.g. `serve shutdown`).
        await self.drain()
