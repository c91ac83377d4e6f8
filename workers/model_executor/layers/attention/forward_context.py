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
def set_forward_context(metadata: Any):
    """metadata: the attention backend's own, for this step."""
    prev = getattr(_local, "meta", None)
    _local.meta = metadata
    try:
        yield
    finally:
        _local.meta = prev


def get_forward_context() -> Any:
    meta = getattr(_local, "meta", None)
    assert meta is not None, "attention ran outside set_forward_context"
    return meta
