"""shoal's loggers inside and outside a Serve replica (proto/replica_logs.py).
The real cluster's check is in test_serve_cluster.py (slow tier)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from shoal.proto import replica_logs


def _serve_module(in_replica: bool) -> types.ModuleType:
    """A stand-in for ray.serve: get_replica_context raises outside a replica, as Serve's does."""
    mod = types.ModuleType("ray.serve")

    def get_replica_context():
        if not in_replica:
            raise RuntimeError("`serve.get_replica_context()` may only be called from within a Ray Serve deployment.")
        return object()

    mod.get_replica_context = get_replica_context
    return mod


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    """The `shoal` and `ray.serve` loggers, put back as they were afterwards
    (other tests read shoal's records through the root logger)."""
    saved = [
        (lg, list(lg.handlers), lg.level, lg.propagate)
        for lg in (logging.getLogger("shoal"), logging.getLogger("ray.serve"))
    ]
    yield saved[0][0], saved[1][0]
    for lg, handlers, level, propagate in saved:
        lg.handlers, lg.level, lg.propagate = handlers, level, propagate


def test_outside_a_replica_nothing_changes(loggers, monkeypatch):
    shoal, serve = loggers
    before = (list(shoal.handlers), shoal.level, shoal.propagate)
    serve.handlers = [_Records()]  # a driver's Serve logger is set up too
    monkeypatch.setitem(sys.modules, "ray.serve", _serve_module(in_replica=False))
    assert not replica_logs.use_serve_handlers()
    monkeypatch.delitem(sys.modules, "ray.serve")
    assert not replica_logs.use_serve_handlers()  # Serve not loaded
    assert (shoal.handlers, shoal.level, shoal.propagate) == before


def test_in_a_replica_shoal_lines_take_serves_handlers_and_level(loggers, monkeypatch):
    shoal, serve = loggers
    monkeypatch.setitem(sys.modules, "ray.serve", _serve_module(in_replica=True))
    out = _Records()
    serve.handlers, serve.level = [out], logging.WARNING  # a deployment's logging_config: WARNING
    assert replica_logs.use_serve_handlers()
    worker_log = logging.getLogger("shoal.workers.worker")
    worker_log.info("request cmpl-1 finished")
    worker_log.warning("request cmpl-2 lost its worker")
    assert out.messages == ["request cmpl-2 lost its worker"]
    serve.level = logging.INFO
    assert replica_logs.use_serve_handlers()
    worker_log.info("request cmpl-3 finished")
    assert out.messages[-1] == "request cmpl-3 finished" and not shoal.propagate
