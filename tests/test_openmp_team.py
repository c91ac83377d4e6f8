"""A thread that stops computing leaves no OpenMP team behind
(platforms/cpu/openmp.py): the engine's steps then run beside no idle team,
and libgomp keeps its full spin at each barrier."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from shoal.workers import LLMEngine
from shoal.workers.model_executor.platforms.cpu import openmp

pytestmark = pytest.mark.skipif(openmp._libgomp() is None, reason="torch here runs on no libgomp with OpenMP 5")


_NAME = b"omp-probe"


def _name_this_thread() -> None:
    """Name the calling thread (Linux's comm); the threads it starts, its
    OpenMP team's among them, inherit the name, so they can be told apart
    from the other threads of the test process, which come and go."""
    libc = ctypes.CDLL(None)
    assert libc.prctl(15, ctypes.c_char_p(_NAME), 0, 0, 0) == 0  # PR_SET_NAME


def _num_threads() -> int:
    """This thread and the threads it started."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                n += f.read().strip() == _NAME
        except FileNotFoundError:  # ended meanwhile
            continue
    return n


def _compute() -> None:
    """A parallel region on the calling thread (an elementwise op over 4M floats)."""
    torch.ones(1 << 22).exp_()


def _on_a_thread(fn):
    """fn() on a fresh thread, with two OpenMP threads; its result or error."""
    box: dict = {}

    def run():
        try:
            _name_this_thread()
            box["result"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_release_ends_the_calling_threads_team():
    def run():
        _compute()
        with_team = _num_threads()
        released = openmp.release_thread_team()
        return with_team, released, _num_threads()

    with_team, released, after = _on_a_thread(run)
    assert released
    assert after == with_team - 1  # its one partner thread is gone


def test_the_thread_that_builds_an_engine_keeps_no_team(tiny_model):
    def run():
        _compute()  # the thread has a team before the engine is built
        engine = LLMEngine(model=tiny_model, num_kv_blocks=64, num_threads=2)
        try:
            built = _num_threads()
            openmp.release_thread_team()
            return built, _num_threads()
        finally:
            engine.shutdown()

    built, after = _on_a_thread(run)
    assert after == built  # nothing left to release
