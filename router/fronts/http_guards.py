"""What stands between the network and the HTTP API: the Host header check
(against DNS rebinding of a local server), the cap on requests served at
once (429, where uvicorn's own limit answers 503), and the race of a
request's work against its client hanging up (vLLM's with_cancellation)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine

LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
# Probes and scrapers call these by the pod's address; their answers are not secret.
OPEN_PATHS = ("/health", "/metrics")


def host_allowlist(allowed_hosts: str | None, api_key: str | None) -> tuple[str, ...] | None:
    """The Host names the API answers (None: any). Default: any when an API
    key guards it, else the loopback names only."""
    if allowed_hosts is None:
        return None if api_key else LOOPBACK
    names = tuple(h.strip().lower() for h in allowed_hosts.split(",") if h.strip())
    return None if "*" in names else names


def _host_name(host: str) -> str:
    """`name:port` -> name; `[v6]:port` -> [v6]."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    name = _host_name(host)
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


async def send_error(send, status: int, etype: str, code: str, message: str, headers=()) -> None:
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HostCheck:
    """400 for a Host header outside `allowed` (starlette's TrustedHostMiddleware
    answers in plain text and redirects www.; this one speaks the API's errors)."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not host_allowed(host, self.allowed):
                await send_error(
                    send,
                    400,
                    "invalid_request_error",
                    "invalid_host",
                    f"Host {host!r} is not served here (--allowed-hosts)",
                )
                return
        await self.app(scope, receive, send)


class AdmissionLimit:
    """At most `limit` HTTP requests in the app at once (a stream counts until
    it ends); past it 429 at once. /health and /metrics are not counted.
    A backstop: generation requests are counted by their sequences once
    parsed (admission.py, against the same limit), which this bounds from
    below; it also bounds what is not generation (/tokenize, LoRA loads)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            await send_error(
                send,
                429,
                "rate_limit_error",
                "too_many_requests",
                f"this router serves {self.limit} requests at once (--max-concurrent-requests); try again later",
                [(b"retry-after", b"1")],
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def until_disconnect(receive, work: Coroutine, name: str | None = None):
    """Run `work` (a request's handling, once its body is read) until it
    returns or the client hangs up; then cancel it, which ends its streams
    and aborts it in the engine. Returns work's result, or None after a hang-up.
    name: the task's (loop_monitor.name_task's form: what a report of a held loop names)."""
    task = asyncio.get_running_loop().create_task(work, name=name)

    async def hang_up() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client went away, or this handler was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    return None if task.cancelled() else task.result()
