"""What an operator reads on the router's HTTP port besides the API:
Prometheus text at /metrics (never behind the key, like /health), and the
status page at / (the files in static/ here: no build step, no CDN)
with the small JSON it polls at /api/status (behind the key, when one is
set: the page asks for it)."""

from __future__ import annotations

import os
import time

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from shoal.proto.lora.modules import LORA_ON_DEVICE
from shoal.router.observability.metrics import CONTENT_TYPE

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The page loads only its own files and may not be framed (clickjacking); its favicon is an empty data: URL.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}


class StatusPage:
    """`frontend`: the replica's Frontend (fronts/frontend.py), read for its
    model, load and metrics; not imported, so observability/ stays below the fronts."""

    def __init__(self, frontend, router: str = "local", routing: str | None = None):
        self.fe, self.router, self.routing = frontend, router, routing

    def routes(self, denied) -> list:
        """`denied(request)` is the API's error response for a request
        without a valid key, or None."""
        self._denied = denied
        return [
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/api/status", self.status, methods=["GET"]),
            Route("/api/auth", self.auth, methods=["GET"]),
            Route("/", self.index, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
        ]

    async def metrics(self, request: Request) -> Response:
        # The workers' figures as of at most 0.5 s ago: a scrape makes no broadcast of its own.
        return Response(self.fe.metrics.render(await self.fe.load_snapshot.get()), media_type=CONTENT_TYPE)

    async def index(self, request: Request) -> Response:
        return FileResponse(
            os.path.join(STATIC_DIR, "index.html"), headers={"Cache-Control": "no-cache", **SECURITY_HEADERS}
        )

    async def auth(self, request: Request) -> Response:
        """Whether requests need the key (open, like /health): the page asks
        for it before its first poll instead of drawing a 401."""
        return JSONResponse({"api_key_required": self.fe.api_key is not None}, headers=SECURITY_HEADERS)

    async def status(self, request: Request) -> Response:
        if (refused := self._denied(request)) is not None:
            return refused
        info, fe = self.fe.info, self.fe
        loads = await fe.load()  # behind the key: the workers as they are now
        p50, p99 = fe.metrics.recent_ttft()
        return JSONResponse(
            {
                "model": info.model,
                "max_model_len": info.max_model_len,
                "tensor_parallel_size": info.tensor_parallel_size,
                "block_size": info.block_size,
                "num_workers": info.num_workers,
                "max_loras": info.max_loras,
                "routing": self.routing,
                "router": self.router,
                "time": time.time(),
                "workers": [
                    {
                        "worker": s.worker,
                        "num_running": s.num_running,
                        "num_waiting": s.num_waiting,
                        "num_free_blocks": s.num_free_blocks,
                        "num_total_blocks": s.num_total_blocks,
                        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                        "num_preemptions": s.num_preemptions,
                        "num_finished_requests": s.num_finished_requests,
                        "num_prompt_tokens": s.num_prompt_tokens,
                        "num_generation_tokens": s.num_generation_tokens,
                        # LoRA adapters in this worker's device slots, and in use by its requests
                        "lora_on_device": sorted(n for n, (_, where) in s.loras.items() if where == LORA_ON_DEVICE),
                        "running_lora_adapters": list(s.running_lora_adapters),
                        "waiting_lora_adapters": list(s.waiting_lora_adapters),
                        # each KV tier's counters (host, disk, cluster: kv_transfer/offloading.py TierStats)
                        "kv_tiers": s.kv_tiers,
                        # what a prefilled token costs there, measured: a tier's fetch of a block is weighed against it
                        "prefill_us_per_token": s.prefill_us_per_token,
                    }
                    for s in loads
                ],
                "router_stats": {
                    "num_requests_running": fe.num_in_flight,
                    "ttft_p50_s": p50,
                    "ttft_p99_s": p99,
                    "window_s": fe.metrics.WINDOW_S,
                },
            },
            headers={"Cache-Control": "no-cache", **SECURITY_HEADERS},
        )
