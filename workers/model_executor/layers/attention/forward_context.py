"""The step's attention metadata, set by the model runner around each
forward (set_forward_context) instead of threaded through every layer."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

# Per thread: two engines in one process (an AsyncEngine's thread and an
# offline LLM in a test, say) must not see each other's step.
_local = threading.local()


@contextmanager
def set_forward_context(metadata: Any, kv_connector: Any = None):
    """metadata: the attention backend's own, for this step; kv_connector: a
    KV connector whose per-layer hooks each attention layer calls (None: no
    hooks, the usual case)."""
    prev = getattr(_local, "meta", None), getattr(_local, "kv_connector", None)
    _local.meta, _local.kv_connector = metadata, kv_connector
    try:
        yield
    finally:
        _local.meta, _local.kv_connector = prev


def get_kv_connector() -> Any:
    """The step's KV connector with per-layer hooks, or None."""
    return getattr(_local, "kv_connector", None)


def get_forward_context() -> Any:
    meta = getattr(_local, "meta", None)
    assert meta is not None, "attention ran outside set_forward_context"
    return meta
