"""Kernel builds cannot hang a start: a build killed half way leaves a lock
that the next start breaks (its owner is gone), a live owner is waited for
with a message saying who, and the wait is bounded. The folder is keyed by
the sources and flags, not the interpreter's path.

The kill test stops the build where torch's loader is about to run ninja
(both locks taken, the ninja file written): the build process, gated
there, says so and blocks reading its stdin; the test then kills it. An
event, not a timing. (Gating the compiler itself would leave it behind:
ninja runs each job in a process group of its own.)"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shoal.workers.model_executor.platforms.cpu import kernel_build
from shoal.workers.model_executor.platforms.cpu.kernel_build import (
    BuildLock,
    KernelBuildTimeout,
    build_key,
    owner_record,
)

TINY = textwrap.dedent(
    """
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "shoal_tiny_ext", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_shoal_tiny_ext(void) { return PyModule_Create(&mod); }
    """
)
TINY_BUILD = (
    "import logging, sys; logging.basicConfig(level=logging.INFO)\n"
    "from shoal.workers.model_executor.platforms.cpu.kernel_build import load_extension\n"
    "print(load_extension('shoal_tiny_ext', [sys.argv[1]]).answer())\n"
)
# Prepended to the first run's code: stop where ninja would start, until killed.
GATE = (
    "import os, subprocess, sys\n"
    "_run = subprocess.run\n"
    "def _gated(cmd, *a, **k):\n"
    "    if cmd and cmd[0] == 'ninja':\n"
    "        open(os.environ['BUILD_STARTED'], 'w').close()\n"
    "        sys.stdin.read()\n"
    "    return _run(cmd, *a, **k)\n"
    "subprocess.run = _gated\n"
)


def _kill_and_restart(code: str, args: list[str], name: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHOAL_KERNEL_CACHE": str(tmp / "cache"), "BUILD_STARTED": str(tmp / "started")}
    first = subprocess.Popen([sys.executable, "-c", GATE + code, *args], env=env, stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # a guard against hanging the suite, not a measurement
        while not (tmp / "started").exists():
            assert first.poll() is None, "the first build ended before it reached ninja"
            assert time.monotonic() < deadline, "the first build never reached ninja"
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
    (folder,) = (tmp / "cache").glob(f"{name}-*")
    # What a killed build leaves: our lock naming it, and torch's bare one.
    assert json.loads((folder / "build.lock").read_text())["pid"] == first.pid
    assert (folder / "lock").exists()
    # Before: this start waited on torch's lock forever (the timeout fails it).
    again = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"broke the stale kernel build lock {folder / 'build.lock'}: its owner, PID {first.pid}" in again.stderr
    assert not (folder / "build.lock").exists() and not (folder / "lock").exists()
    return again


def test_a_build_killed_half_way_is_taken_up_by_the_next_start(tmp_path):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    again = _kill_and_restart(TINY_BUILD, [str(src)], "shoal_tiny_ext", tmp_path)
    assert again.stdout.strip() == "42"
    # The build is reused, not redone, from another path to the same venv
    # (torch's loader cannot even be called).
    venv = Path(sys.prefix)
    (tmp_path / "venv").symlink_to(venv, target_is_directory=True)
    python = tmp_path / "venv" / Path(sys.executable).relative_to(venv)
    no_build = "import torch.utils.cpp_extension as c\nc.load = None\n" + TINY_BUILD
    env = {**os.environ, "SHOAL_KERNEL_CACHE": str(tmp_path / "cache")}
    reused = subprocess.run([str(python), "-c", no_build, str(src)], env=env, capture_output=True, text=True)
    assert reused.returncode == 0 and reused.stdout.strip() == "42", reused.stderr[-3000:]


# ---- the lock ---------------------------------------------------------------


@pytest.fixture
def live_owner():
    """A process that lives until the test ends it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait()


def _lock_held_by(path: Path, owner: dict) -> Path:
    path.write_text(json.dumps(owner))
    return path


def test_a_lock_whose_owner_is_gone_is_broken(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = BuildLock(str(_lock_held_by(tmp_path / "build.lock", owner_record(dead.pid) | {"start": None})), 0)
    with caplog.at_level(logging.WARNING, kernel_build.__name__), lock:
        assert json.loads((tmp_path / "build.lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "build.lock").exists()
    assert f"PID {dead.pid} on {socket.gethostname()}, is gone" in caplog.text


def test_a_zombie_or_a_reused_pid_is_no_owner(tmp_path, live_owner):
    zombie = subprocess.Popen(["true"])
    while kernel_build._proc_start(zombie.pid)[0] != "Z":  # exited, not reaped: an event
        time.sleep(0.01)
    try:
        for owner in (owner_record(zombie.pid), owner_record(live_owner.pid) | {"start": -1}):
            assert not kernel_build.owner_alive(owner)
            with BuildLock(str(_lock_held_by(tmp_path / "build.lock", owner)), 0):
                pass
    finally:
        zombie.wait()
    assert kernel_build.owner_alive(owner_record(live_owner.pid))


def test_a_live_owner_is_waited_for_with_a_message_then_its_death_frees_the_lock(tmp_path, live_owner):
    path = _lock_held_by(tmp_path / "build.lock", owner_record(live_owner.pid))
    waiting = threading.Event()
    messages = []

    class Seen(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            if "waiting for the kernel build lock" in messages[-1]:
                waiting.set()

    handler = Seen()
    kernel_build.logger.addHandler(handler)
    lock = BuildLock(str(path), timeout_s=600, log_every_s=3600, poll_s=0.02)
    taker = threading.Thread(target=lock.acquire)
    try:
        taker.start()
        assert waiting.wait(120)
        assert taker.is_alive()  # the owner lives: still waiting
        assert f"waiting for the kernel build lock {path}, held by PID {live_owner.pid} on" in messages[0]
        live_owner.kill()
        live_owner.wait()
        taker.join(120)
        assert not taker.is_alive()
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        kernel_build.logger.removeHandler(handler)
        lock.release()


def test_the_wait_is_bounded_with_a_clear_error(tmp_path, live_owner, caplog):
    path = tmp_path / "build.lock"
    for owner, who in (
        (owner_record(live_owner.pid), f"PID {live_owner.pid} on {socket.gethostname()}"),
        ({"pid": 1, "host": "another-host", "start": None}, "PID 1 on another-host"),  # cannot tell: waited for
    ):
        _lock_held_by(path, owner)
        with caplog.at_level(logging.WARNING, kernel_build.__name__):
            with pytest.raises(KernelBuildTimeout, match=f"waiting for the kernel build lock {path}, held by {who}"):
                BuildLock(str(path), timeout_s=0).acquire()
        assert f"held by {who}" in caplog.text
        assert json.loads(path.read_text()) == owner  # left alone


def test_the_build_key_follows_sources_and_flags_not_the_interpreter_path(tmp_path, monkeypatch):
    (tmp_path / "a.cpp").write_text("int a;")
    (tmp_path / "a.h").write_text("// header")
    src = [str(tmp_path / "a.cpp")]
    key = build_key("x", src, ["-O3"], [])
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert build_key("x", src, ["-O3"], []) == key
    assert build_key("x", src, ["-O2"], []) != key
    assert build_key("x", src, ["-O3"], ["-fopenmp"]) != key
    (tmp_path / "a.h").write_text("// a changed header")
    assert build_key("x", src, ["-O3"], []) != key


def test_a_build_lock_held_past_the_bound_fails_the_kernels_load_clearly(monkeypatch):
    """Not a quiet fall-back to the torch path: the start fails naming the lock."""
    from shoal.workers.model_executor.platforms.cpu import kernel_build
    from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

    def held(*a, **k):
        raise KernelBuildTimeout("waiting for the kernel build lock /x/build.lock, held by PID 1")

    monkeypatch.setattr(kernel_build, "load_extension", held)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_kernel", None)
    for _ in range(2):  # and again on the next call: a timeout is not remembered as "no kernels"
        with pytest.raises(KernelBuildTimeout, match="held by PID 1"):
            cpu_kernels.load()
