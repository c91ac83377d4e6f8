"""Builds a torch C++ extension once per distinct build, safely across processes.

torch's loader keeps its builds in a folder named after the extension and
guards it with a bare `lock` file: a process killed while compiling leaves
that file behind, and every later start waits on it forever without a word.
Its ninja file also holds the interpreter's include paths, so the same build
is redone from another venv path. Here instead:

- the folder is `<cache>/<name>-<key>`, the key a hash of the sources (and the
  headers beside them) and what changes the binary: flags, compiler, torch,
  the Python ABI, the machine (and its CPU flags under -march=native), never
  the venv's path. A finished build leaves a `built` marker and is imported
  from there directly, without torch's loader;
- a build runs under our own lock (`build.lock`, naming its owner's PID, host
  and start time). A lock whose owner is gone is broken; while the owner
  lives, the waiter logs what it waits for every few seconds and gives up
  after SHOAL_KERNEL_BUILD_TIMEOUT seconds (default 900) with an error that
  names the lock and its owner. Holding our lock, torch's own `lock` in the
  folder can only be a killed build's, and is removed.

The cache is SHOAL_KERNEL_CACHE, else TORCH_EXTENSIONS_DIR, else
~/.cache/shoal/kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import cast

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 900.0
_HEADERS = (".h", ".hpp", ".cuh", ".inc")
_in_process = threading.Lock()  # a second thread of this process waits here, not on the file


class KernelBuildTimeout(TimeoutError):
    pass


def cache_root() -> str:
    root = os.environ.get("SHOAL_KERNEL_CACHE") or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "shoal", "kernels")
    return root


def build_timeout_s() -> float:
    return float(os.environ.get("SHOAL_KERNEL_BUILD_TIMEOUT", DEFAULT_TIMEOUT_S))


def _cpu_flags() -> str:
    """The CPU's feature flags: a -march=native binary runs only where they hold."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    return platform.processor()


def build_key(name: str, sources: list[str], extra_cflags: Sequence[str], extra_ldflags: Sequence[str]) -> str:
    """A hash of everything that changes the binary, and nothing that does not
    (the interpreter's or the venv's path)."""
    import torch

    h = hashlib.sha256()
    parts = {
        "name": name,
        "cflags": list(extra_cflags),
        "ldflags": list(extra_ldflags),
        "cxx": os.environ.get("CXX", "c++"),
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "cpu": _cpu_flags() if "-march=native" in extra_cflags else "",
    }
    h.update(json.dumps(parts, sort_keys=True).encode())
    dirs = sorted({os.path.dirname(os.path.abspath(s)) for s in sources})
    headers = sorted(os.path.join(d, f) for d in dirs for f in os.listdir(d) if f.endswith(_HEADERS))
    for path in [*sources, *headers]:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _proc_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, from /proc (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_record(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    stat = _proc_start(pid)
    return {"pid": pid, "host": socket.gethostname(), "start": stat[1] if stat else None}


def owner_alive(owner: dict) -> bool:
    """False only when the owner is surely gone: same host, and its PID is
    free, a zombie, or a later process's (another start time)."""
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell from here
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False  # this process does not hold it (builds in it are serialized)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    stat = _proc_start(pid)
    if stat is not None and (stat[0] == "Z" or (owner.get("start") is not None and stat[1] != owner["start"])):
        return False
    return True


@dataclass(slots=True)
class BuildLock:
    """A lock file naming its owner; broken when the owner is gone."""

    path: str
    timeout_s: float = field(default_factory=build_timeout_s)
    log_every_s: float = 5.0
    poll_s: float = 0.2
    owner: dict = field(default_factory=dict)

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _try_create(self) -> bool:
        # Written whole to a private file, then linked into place: the lock
        # never exists half written (a link fails where the name exists).
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump(self.owner, f)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _break(self, stale: dict) -> None:
        # Under a guard, and only if the lock still names the stale owner:
        # two waiters must not both break it, the second removing the lock
        # the first has just taken.
        with open(self.path + ".guard", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                if self._read() == stale:
                    os.unlink(self.path)
                    logger.warning(
                        "broke the stale kernel build lock %s: its owner, PID %s on %s, is gone",
                        self.path,
                        stale.get("pid"),
                        stale.get("host"),
                    )
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def acquire(self) -> None:
        self.owner = owner_record()
        start = time.monotonic()
        next_log = start
        while True:
            if self._try_create():
                return
            holder = self._read()
            if holder is None and not os.path.exists(self.path):
                continue  # released in between: try again at once
            if holder is not None and not owner_alive(holder):
                self._break(holder)
                continue
            now = time.monotonic()
            who = f"PID {holder.get('pid')} on {holder.get('host')}" if holder else "an owner not yet written"
            if now >= next_log:
                logger.warning(
                    "waiting for the kernel build lock %s, held by %s (%.0f s so far, giving up at %.0f s)",
                    self.path,
                    who,
                    now - start,
                    self.timeout_s,
                )
                next_log = now + self.log_every_s
            if now - start >= self.timeout_s:
                raise KernelBuildTimeout(
                    f"gave up after {self.timeout_s:.0f} s waiting for the kernel build lock {self.path}, "
                    f"held by {who}, which is still running; remove the file if no build is running there, "
                    "or raise SHOAL_KERNEL_BUILD_TIMEOUT"
                )
            time.sleep(self.poll_s)

    def release(self) -> None:
        if self._read() == self.owner:
            os.unlink(self.path)

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _import_built(folder: str) -> ModuleType | None:
    """The module a finished build left in `folder`, or None."""
    try:
        with open(os.path.join(folder, "built")) as f:
            built = json.load(f)
        # a spec or loader missing raises below, and the build is taken for damaged
        spec = cast(
            ModuleSpec, importlib.util.spec_from_file_location(built["module"], os.path.join(folder, built["file"]))
        )
        module = importlib.util.module_from_spec(spec)
        cast(Loader, spec.loader).exec_module(module)
        return module
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged build: built again
        logger.warning("the kernel build in %s does not load (%s); building it again", folder, e)
        return None


def load_extension(
    name: str,
    sources: list[str],
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    timeout_s: float | None = None,
) -> ModuleType:
    """torch.utils.cpp_extension.load, built once per key into its own folder
    under a lock that cannot hang a start (see the module's docstring)."""
    import torch  # noqa: F401  (the extension links libtorch: loaded first)

    folder = os.path.join(cache_root(), f"{name}-{build_key(name, sources, extra_cflags, extra_ldflags)}")
    os.makedirs(folder, exist_ok=True)
    with _in_process:
        module = _import_built(folder)
        if module is not None:
            return module
        timeout_s = build_timeout_s() if timeout_s is None else timeout_s
        with BuildLock(os.path.join(folder, "build.lock"), timeout_s):
            module = _import_built(folder)  # built while this process waited
            if module is not None:
                return module
            for leftover in ("lock", "built"):  # a killed build's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, leftover))
            from torch.utils.cpp_extension import load

            logger.warning("building the %s kernels into %s (once; this takes a few minutes)", name, folder)
            module = load(
                name,
                list(sources),
                extra_cflags=list(extra_cflags),
                extra_ldflags=list(extra_ldflags),
                build_directory=folder,
            )
            built = {"module": module.__name__, "file": os.path.basename(module.__file__)}
            tmp = os.path.join(folder, f"built.{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(built, f)
            os.replace(tmp, os.path.join(folder, "built"))
            return module
