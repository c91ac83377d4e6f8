"""mypy over the contract (proto/, strict), the router and the Protocols' implementers: attention
backends and layer, executors, linear methods, platforms (the CPU decode step), model runners and
structured-output (grammar) backends.

    .venv/bin/python scripts/typecheck.py          # `make lint` runs it
    .venv/bin/python scripts/typecheck.py -- --no-incremental   # extra arguments go to mypy

The folders map to `shoal.<folder>` through pyproject's package-dir, which an
editable install serves through an import hook mypy cannot follow; so, as
scripts/gpu_check.py does, the source is laid out as shoal/<folder> symbolic
links under .mypy_cache/layout and mypy runs over that, its cache beside it.
Its settings (strict on shoal.proto.*, third-party libraries without types)
are pyproject's [tool.mypy].
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mypy's cache and the layout it reads through (ruff and .dockerignore pass .mypy_cache by; git, by the .gitignore
# layout() writes there).
CACHE = os.path.join(ROOT, ".mypy_cache")
FOLDERS = ("workers", "router", "cluster", "proto", "benchmarks")
# What mypy checks (the modules these import are read for their types, not reported on).
PACKAGES = (
    "shoal.proto",
    "shoal.router",
    # the Protocols and their implementers: attention backends (and the layer they read, AttentionLayer), executors,
    # linear methods, the CPU decode step (DecodeStep), runners (Runner) and grammar backends (StructuredOutputBackend)
    "shoal.workers.model_executor.layers.attention.backends",
    "shoal.workers.model_executor.layers.attention.layer",
    "shoal.workers.model_executor.executor",
    "shoal.workers.model_executor.layers.quantization",
    "shoal.workers.model_executor.platforms",
    "shoal.workers.model_executor.runner",
    "shoal.workers.structured_output",
    # the KV connector seam: KVConnectorBase, its connectors, and (base.py) the scheduler's view of one
    "shoal.workers.kv_transfer",
)
# Modules bound for proto/ that still live in workers/ (strict there too, through pyproject's overrides).
MODULES = ("shoal.workers.core.outputs",)


def layout(dest: str) -> str:
    """dest/shoal/<folder> -> ROOT/<folder>, kept between runs (mypy's cache is keyed
    by path); returns dest."""
    os.makedirs(os.path.join(dest, "shoal"), exist_ok=True)
    ignore = os.path.join(CACHE, ".gitignore")
    if not os.path.exists(ignore):
        with open(ignore, "w") as f:
            f.write("*\n")
    for folder in FOLDERS:
        link, target = os.path.join(dest, "shoal", folder), os.path.join(ROOT, folder)
        if os.path.islink(link) and os.readlink(link) != target:  # the checkout moved
            os.remove(link)
        if not os.path.islink(link):
            os.symlink(target, link)
    return dest


def module_file(name: str) -> str:
    """shoal.<folder>.a.b -> ROOT/<folder>/a/b.py"""
    return os.path.join(ROOT, *name.split(".")[1:]) + ".py"


def command(extra: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml")]
    argv += ["--cache-dir", os.path.join(CACHE, "cache")]
    for name in PACKAGES:
        argv += ["-p", name]
    for name in MODULES:
        if os.path.exists(module_file(name)):  # gone once moved into proto/ (then checked there)
            argv += ["-m", name]
    return argv + extra


def main(argv: list[str]) -> int:
    extra = argv[1:] if argv[:1] == ["--"] else argv
    dest = layout(os.path.join(CACHE, "layout"))
    env = dict(os.environ, MYPYPATH=dest)
    # From dest, mypy names files shoal/<folder>/... (under the repository, <folder>/...).
    return subprocess.call(command(extra), cwd=dest, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
