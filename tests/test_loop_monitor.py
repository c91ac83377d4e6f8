"""The router's event-loop monitor (router/observability/loop_monitor.py): a
callback that holds the loop past 0.1 s is logged with the loop thread's
stack and its request id while it holds it, and the lag gauge shows the
stall after. The loop is held on a threading.Event that a helper thread
sets once the warning is logged: nothing here waits on a clock."""

from __future__ import annotations

import asyncio
import logging
import threading

from engine_hold import until
from serving import http_client, make_frontend

from shoal.router.fronts import parallel_sampling
from shoal.router.observability.loop_monitor import LoopMonitor

LOGGER = "shoal.router.observability.loop_monitor"


class _Held:
    """A hold on the loop thread, released by a helper thread once the
    watchdog's warning (the loop 'has been held') is logged."""

    def __init__(self):
        self.records: list[logging.LogRecord] = []
        self.logged, self.release = threading.Event(), threading.Event()
        self.handler = logging.Handler()
        self.handler.emit = self._emit
        threading.Thread(target=self._releaser, daemon=True).start()

    def _emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        msg = record.getMessage()
        if "has been held" in msg and ", in hold\n" in msg:  # this hold's (a busy machine may add others)
            self.logged.set()

    def _releaser(self) -> None:
        self.logged.wait(30)  # a bound for a broken watchdog only: the test then fails, it does not hang
        self.release.set()

    def hold(self) -> None:
        """Called on the loop thread: blocks it until released."""
        self.release.wait(30)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def __enter__(self):
        logging.getLogger(LOGGER).addHandler(self.handler)
        logging.getLogger(LOGGER).setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc):
        self.release.set()
        logging.getLogger(LOGGER).removeHandler(self.handler)


def _gauge(text: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith("shoal:router_event_loop_lag_seconds{")]
    return float(line.rsplit(" ", 1)[1])


def test_a_request_holding_the_loop_is_logged_with_its_id_and_the_gauge_shows_it(tiny_model, monkeypatch):
    check = parallel_sampling.check

    def holding_check(*args, **kwargs):  # runs on the loop, in the request's task
        held.hold()
        return check(*args, **kwargs)

    monkeypatch.setattr(parallel_sampling, "check", holding_check)

    async def main():
        fe = make_frontend(tiny_model)
        async with http_client(fe) as c:  # which runs a router's loop monitor, as ingress.Router does
            before = _gauge(fe.metrics.render([]).decode())
            r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            came_back = await until(lambda: any("came back" in m for m in held.messages()))
            after = _gauge(fe.metrics.render([]).decode())
        return r, before, came_back, after

    with _Held() as held:
        r, before, came_back, after = asyncio.run(main())
    assert r.status_code == 200
    rid = r.json()["id"]
    (report,) = [m for m in held.messages() if "has been held" in m and "holding_check" in m]
    assert f"request {rid}" in report  # its id, and (above) where the loop thread is
    assert came_back < 10 and any(f"request {rid}" in m for m in held.messages() if "came back" in m)
    assert before < 0.1 < after


def test_a_callback_outside_a_request_task_is_found_by_the_request_id_it_holds():
    def callback(request_id: str) -> None:
        held.hold()

    async def main():
        monitor = LoopMonitor()
        monitor.start()
        try:
            asyncio.get_running_loop().call_soon(callback, "cmpl-outside")
            await until(lambda: any("came back" in m for m in held.messages()))  # the tick after the stall
        finally:
            monitor.stop()
        return monitor.lag_s()

    with _Held() as held:
        lag = asyncio.run(main())
    (report,) = [m for m in held.messages() if "has been held" in m and "in callback" in m]
    assert "request cmpl-outside" in report and "task None" in report and lag > 0.1
