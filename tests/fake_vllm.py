"""A stand-in `vllm` package for the vLLM peer's tests (no test installs
vLLM): written to a folder put on a Python's path, with vLLM's names for the
parts the driver uses. Its LLM starts a child process by spawn, as vLLM's
engine core does, so a driver without a main guard fails under it as under
vLLM; every call is recorded in $FAKE_VLLM_RECORD (JSON lines)."""

from __future__ import annotations

import os
import sys

INIT = """
import json, multiprocessing, os
from dataclasses import dataclass

__version__ = "0.0.fake"


def _record(**kw):
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
        f.write(json.dumps(kw) + "\\n")


def _engine_core():
    pass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


class _Out:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Request:
    def __init__(self, outputs):
        self.outputs = outputs


class LLM:
    def __init__(self, model, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        core = multiprocessing.get_context("spawn").Process(target=_engine_core)
        core.start()
        core.join()
        if core.exitcode != 0:
            raise RuntimeError("engine core died")
        _record(call="LLM", model=model, **kwargs)

    def generate(self, prompts, params, use_tqdm=True):
        _record(
            call="generate",
            prompts=[p["prompt_token_ids"] for p in prompts],
            params=[[s.temperature, s.max_tokens, s.ignore_eos] for s in params],
        )
        # greedy stand-in: the prompt's last id, then counting up
        return [_Request([_Out([p["prompt_token_ids"][-1] + i for i in range(s.max_tokens)])]) for p, s in zip(prompts, params)]
"""

INPUTS = """
class TokensPrompt(dict):
    pass
"""


def write_fake_vllm(root: str) -> str:
    """The package under root/vllm; returns root (to put on PYTHONPATH)."""
    pkg = os.path.join(root, "vllm")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write(INIT)
    with open(os.path.join(pkg, "inputs.py"), "w") as f:
        f.write(INPUTS)
    # `vllm serve` (run through benchmarks/vllm_cli.py): an OpenAI-compatible stand-in streaming "x" tokens
    cli = os.path.join(pkg, "entrypoints", "cli")
    os.makedirs(cli, exist_ok=True)
    for d in (os.path.join(pkg, "entrypoints"), cli):
        open(os.path.join(d, "__init__.py"), "w").close()
    with open(os.path.join(cli, "main.py"), "w") as f:
        f.write(SERVE)
    return root


def write_fake_env(env: str, record: str) -> str:
    """A peer environment holding the fake package: bin/python runs this
    interpreter with it on the path (the peer's environment is cleaned of
    PYTHONPATH, so the wrapper sets its own), marked ready. Returns env."""
    from shoal.benchmarks import vllm_peer

    root = write_fake_vllm(os.path.join(env, "site"))
    os.makedirs(os.path.join(env, "bin"), exist_ok=True)
    py = os.path.join(env, "bin", "python")
    with open(py, "w") as f:
        f.write(f'#!/bin/sh\nPYTHONPATH={root} FAKE_VLLM_RECORD={record} exec {sys.executable} "$@"\n')
    os.chmod(py, 0o755)
    with open(os.path.join(env, vllm_peer.READY), "w") as f:
        f.write(vllm_peer.VLLM_VERSION)
    return env


SERVE = """
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

flags = {}


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == flags["--served-model-name"] and body["ignore_eos"] and body["temperature"] == 0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\\n\\n")
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\\n\\ndata: [DONE]\\n\\n")



def main():
    args = sys.argv[1:]
    assert sys.argv[0] == "vllm" and args[0] == "serve", sys.argv
    if os.environ.get("FAKE_VLLM_FAIL"):
        print(os.environ["FAKE_VLLM_FAIL"], flush=True)
        sys.exit(132)
    flags.update(zip(args[2::2], args[3::2]))
    rec = {"call": "serve", "model": args[1], **flags, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
        f.write(json.dumps(rec) + "\\n")
    # its engine core: a child that must not outlive the server
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
        f.write(json.dumps({"call": "core", "pid": core.pid}) + "\\n")
    time.sleep(1.0)  # not ready at once: the bench must wait for /health
    ThreadingHTTPServer((flags["--host"], int(flags["--port"])), H).serve_forever()
"""
