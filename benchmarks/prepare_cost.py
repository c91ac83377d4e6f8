"""shoal bench prepare: what the router spends preparing one request from
its token ids (the request check, SamplingParams and the prefix-cache
chain; tokenization is the tokenizer's and not counted), in this tree and
in a baseline revision, timed in turns in one run.

The baseline is a detached git worktree of --baseline laid out as the
`shoal` namespace, each tree timed in its own subprocess, so the two never
share a module; rounds alternate and each side keeps its best."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shoal.benchmarks.baseline_tree import ROOT, baseline_and_current

# Runs inside either tree: old fronts had _prepare(Prompt, sampling), new ones _check(ids, sampling);
# before the router's rooms the fronts sat at shoal.router.*.
_SNIPPET = r"""
import json, sys, time
try:
    from shoal.router.fronts.frontend import Frontend, ModelInfo
    from shoal.router.fronts.prompt import Prompt, tokenize
except ImportError:
    from shoal.router.frontend import Frontend, ModelInfo
    from shoal.router.prompt import Prompt, tokenize
from shoal.proto.block_hash import chain_hashes
num_tokens, block_size, calls = map(int, sys.argv[1:4])
fe = Frontend(None, None, ModelInfo("m", 8192, 49152, block_size, 1, 1))
ids = [(i * 7919) % 49152 for i in range(num_tokens)]
sampling = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n\n"]}
if hasattr(fe, "_check"):
    def prepare():
        got, _ = fe._check(tokenize(Prompt(token_ids=ids), None), sampling)
        chain_hashes(got, block_size)
else:
    def prepare():
        got, _ = fe._prepare(Prompt(token_ids=ids), sampling)
        chain_hashes(got, block_size)
prepare()
t0 = time.perf_counter()
for _ in range(calls):
    prepare()
print(json.dumps((time.perf_counter() - t0) / calls * 1e6))
"""


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="router-side cost of preparing one request, here vs a baseline revision")
    p.add_argument("--baseline", default="HEAD", help="git revision to compare with (default: HEAD)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1000], help="prompt lengths in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="preparations timed per round")
    p.add_argument("--output", default="bench_results/prepare.json")
    p.set_defaults(func=run)


def time_tree(path: str, num_tokens: int, block_size: int, calls: int) -> float:
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET, str(num_tokens), str(block_size), str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=path,
    )
    return float(out.stdout.strip().splitlines()[-1])


def run(ns) -> int:
    with baseline_and_current(ns.baseline) as trees:
        rows = []
        for n in ns.tokens:
            best = {name: float("inf") for name in trees}
            for _ in range(ns.rounds):
                for name, path in trees.items():
                    best[name] = min(best[name], time_tree(path, n, ns.block_size, ns.calls))
            rows.append(
                {
                    "tokens": n,
                    "baseline_us": best["baseline"],
                    "current_us": best["current"],
                    "added_us": best["current"] - best["baseline"],
                }
            )
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", ns.baseline], capture_output=True, text=True)
    print(
        f"router-side preparation from token ids, block size {ns.block_size}, best of {ns.rounds} rounds of "
        f"{ns.calls} (baseline {rev.stdout.strip()})"
    )
    print(f"{'tokens':>8} {'baseline us':>12} {'current us':>11} {'added us':>9}")
    for r in rows:
        print(f"{r['tokens']:>8} {r['baseline_us']:>12.1f} {r['current_us']:>11.1f} {r['added_us']:>+9.1f}")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"baseline": ns.baseline, "block_size": ns.block_size, "rows": rows}, f, indent=1)
    print(f"wrote {ns.output}")
    return 0
