"""A baseline revision and this checkout, each importable as `shoal` from its
own folder, for benches that compare the two in one run.

The baseline is a detached git worktree of the revision; each side is a
folder holding `shoal/<package>` symlinks, put first on a subprocess's
PYTHONPATH, so the two never share a module."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

# The checkout, also when this runs from a tree of symlinks below it.
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
PACKAGES = ("workers", "router", "cluster", "proto", "benchmarks")


def shoal_tree(src: str, dest: str) -> str:
    """`dest`/shoal/<package> -> `src`/<package>: importable as `shoal.*` from dest."""
    os.makedirs(os.path.join(dest, "shoal"), exist_ok=True)
    for name in PACKAGES:
        if os.path.isdir(os.path.join(src, name)):
            os.symlink(os.path.join(src, name), os.path.join(dest, "shoal", name))
    return dest


@contextlib.contextmanager
def baseline_and_current(rev: str) -> Iterator[dict[str, str]]:
    """{"baseline": path, "current": path}, each a PYTHONPATH entry; the
    worktree is removed on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        worktree = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", worktree, rev], check=True)
        try:
            yield {
                "baseline": shoal_tree(worktree, os.path.join(tmp, "ns-baseline")),
                "current": shoal_tree(ROOT, os.path.join(tmp, "ns-current")),
            }
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree], check=False)
