"""Named ranges of an engine step, for whoever profiles it.

The engine, the model runner and the CPU decode step mark their parts
(`with step_range("sample"):`). Off, which is always unless a profiler
turns them on, a range is one shared null context. On (`enable()`), each
range is timed on the host, summed by name (`seconds()`), and is a
torch.profiler.record_function of the same name, so a torch.profiler
trace shows it too. `shoal bench latency --profile` reads them.
"""

from __future__ import annotations

import contextlib
import time

import torch

# The ranges, outermost first: the engine's, then the runner's, then the CPU decode step's.
RANGES = (
    "schedule",
    "grammar_bitmask",
    "execute_model",
    "update_from_output",
    "detokenize",
    "prepare_inputs",
    "forward",
    "sample",
    "decoder_layers",
    "compute_logits",
    "attention_prefill",
    "attention_decode",
)

_NULL = contextlib.nullcontext()
_enabled = False
_seconds: dict[str, float] = {}


class _Range:
    __slots__ = ("name", "record", "t0")

    def __init__(self, name: str):
        self.name = name
        self.record = torch.profiler.record_function(name)

    def __enter__(self):
        self.record.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        _seconds[self.name] = _seconds.get(self.name, 0.0) + time.perf_counter() - self.t0
        self.record.__exit__(*exc)


def step_range(name: str):
    """A context that marks `name` (one of RANGES) while ranges are on."""
    return _Range(name) if _enabled else _NULL


def enable(on: bool = True) -> None:
    """Turn the ranges on (and zero their sums) or off, for this process."""
    global _enabled
    _enabled = on
    _seconds.clear()


def seconds() -> dict[str, float]:
    """Host seconds spent in each range since enable(), by name."""
    return dict(_seconds)


def reset() -> None:
    _seconds.clear()
