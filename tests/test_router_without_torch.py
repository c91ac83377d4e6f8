"""The router's processes never load torch: every router and cluster module
imports without it, and a router front built over the default model's
tokenizer prepares a request without it (fresh interpreters, since this
one has torch already)."""

from __future__ import annotations

import os
import subprocess
import sys

from test_imports import module_files

LIGHT = ("shoal.workers.engine_args",)


def _run(code: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_no_router_or_cluster_module_imports_torch():
    names = sorted(n for n in module_files() if n.startswith(("shoal.router", "shoal.cluster", "shoal.proto")))
    # every room of the router is walked (fronts, routing, observability)
    assert {"shoal.router.fronts.ingress", "shoal.router.routing.request_router"} <= set(names)
    assert "shoal.router.observability.status_page" in names
    names += LIGHT
    out = _run(
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, name\n"
        "print(len(sys.modules))\n"
    )
    assert int(out.strip()) > 100  # they did import


def test_a_router_front_prepares_a_request_without_torch(tiny_model):
    out = _run(f"""
import asyncio, sys
from shoal.router.fronts.frontend import Frontend, ModelInfo
from shoal.router.fronts.openai_app import OpenAIApp
from shoal.router.fronts.prompt import Prompt
from shoal.proto.tokenizer import load_tokenizer

tok = load_tokenizer({tiny_model!r})
fe = Frontend(None, tok, ModelInfo("tiny", 256, 512, 16, 1, 1))
OpenAIApp(fe, 1 << 20)
ids, params = asyncio.run(fe.prepare(Prompt(text="The quick brown fox"), {{"max_tokens": 4, "temperature": 0.5}}))
assert ids and params.max_tokens == 4
print("torch" in sys.modules)
""")
    assert out.strip() == "False"
