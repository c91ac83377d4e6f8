"""A router as clients reach it, without Ray: the HTTP app under uvicorn on a
real port and the gRPC server, over in-process Workers on a tiny model, all
on one event loop in a background thread (the router's one loop, as in a
replica). The fuzz tests drive it with real clients and watch /health."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
from serving import free_port

from shoal.cluster.options import ServeOptions
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.fronts.grpc_server import GrpcServer
from shoal.router.fronts.ingress import start_http
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.observability.status_page import StatusPage
from shoal.router.routing.worker_pool import LocalWorkerPool
from shoal.workers import EngineArgs
from shoal.workers.worker import Worker

KEY = "fuzz-key"


class LiveRouter:
    """start() returns once both ports answer; stop() shuts all down."""

    def __init__(
        self,
        model: str,
        num_workers: int = 2,
        tool_call_parser: str | None = "hermes",
        lora_root: str | None = None,
        **engine,
    ):
        """lora_root: runtime LoRA loads on, from inside this folder only (None: LoRA off)."""
        self.lora_root = lora_root
        if lora_root is not None:
            engine.update(enable_lora=True, lora_root=lora_root)
        engine.setdefault("num_kv_blocks", 128)
        engine.setdefault("num_threads", 1)
        self.model, self.num_workers, self.engine = model, num_workers, engine
        self.tool_call_parser = tool_call_parser
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-router", daemon=True)
        self.http_port, self.grpc_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"

    def start(self) -> LiveRouter:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(120)
        return self

    async def _start(self) -> None:
        opts = ServeOptions()
        self.workers = [
            Worker(EngineArgs(model=self.model, **self.engine), max_waiting=opts.max_waiting)
            for _ in range(self.num_workers)
        ]
        info = ModelInfo.from_worker_info(self.workers[0].info(), self.num_workers)
        tokenizer = self.workers[0].engine.engine.tokenizer
        lora = {} if self.lora_root is None else {"allow_runtime_lora_updating": True, "lora_root": self.lora_root}
        self.fe = Frontend(LocalWorkerPool(self.workers), tokenizer, info, KEY, opts.max_prompts, **lora)
        app = OpenAIApp(
            self.fe,
            opts.max_request_bytes,
            StatusPage(self.fe),
            opts.max_concurrent_requests,
            tool_call_parser=self.tool_call_parser,
        ).app
        self.http, self._http_task = await start_http(app, "127.0.0.1", self.http_port)
        self.grpc = GrpcServer(
            self.fe,
            "127.0.0.1",
            self.grpc_port,
            opts.max_request_bytes,
            opts.max_concurrent_requests,
            tool_call_parser=self.tool_call_parser,
        )
        await self.grpc.start()
        self.engines = [w.engine for w in self.workers]

    def engines_alive(self) -> list[str]:
        """What is wrong with the workers: an engine that failed or was replaced (empty: none)."""
        wrong = []
        for w, engine in zip(self.workers, self.engines):
            if w.engine is not engine:
                wrong.append(f"{w!r}: its engine was replaced")
            if w.engine.failed is not None:
                wrong.append(f"{w!r}: engine failed: {w.engine.failed!r}")
        return wrong

    def stop(self) -> None:
        async def stop():
            await self.grpc.stop(0)
            self.http.should_exit = True
            await asyncio.wait_for(self._http_task, 10)
            for w in self.workers:
                await w.engine.shutdown()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@dataclass(slots=True)
class HealthWatch:
    """Polls GET /health every `period_s` from its own thread; each answer
    is noted with its status and how long it took (timeouts included)."""

    url: str
    period_s: float = 0.2
    timeout_s: float = 1.0
    answers: list[tuple[int | str, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HealthWatch:
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.wait(self.period_s):
                t0 = time.monotonic()
                try:
                    status: int | str = client.get(self.url).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.answers.append((status, time.monotonic() - t0))

    def problems(self) -> list[tuple[int | str, float]]:
        """Answers that were not a 200 within the timeout."""
        return [(s, t) for s, t in self.answers if s != 200 or t > self.timeout_s]
