"""n = 1 against n = 4 on one long prompt, offline engine (no Ray): the
request's time to first token, the time until every choice has its first,
and the prompt tokens computed. The n samples are siblings of one group (as
the router sends them: one prefill, the others share its blocks); the same
samples as independent requests, added together, for comparison (the prefix
cache, when on, lets those share too when they arrive in one step).

    python -m shoal.benchmarks.parallel_sampling [--input-len 1000] [--n 4] [engine flags]

Each run draws a new random prompt (no prefix-cache hit between runs); the
three shapes take turns, each first in turn, so drift in the machine's speed
hits them alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs


def measure(engine, prompt: list[int], n: int, output_len: int, grouped: bool) -> tuple[float, float, int]:
    """(s to the request's first token, s until each of its n samples has one, prompt tokens computed)."""
    from shoal.workers import SamplingParams

    tag = f"ps-{time.perf_counter_ns()}"
    computed, schedule = [0], engine.scheduler.schedule

    def counting():
        out = schedule()
        computed[0] += sum(k for _, k in out.scheduled if k > 1)
        return out

    engine.scheduler.schedule = counting
    try:
        t0 = time.perf_counter()
        for k in range(n):
            params = SamplingParams(temperature=1.0, seed=k, max_tokens=output_len, ignore_eos=True)
            engine.add_request(
                GenerateRequest(
                    f"{tag}-{k}", engine.tokenize(prompt), params, parent_request_id=f"{tag}-0" if grouped else None
                )
            )
        firsts: dict[str, float] = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.new_token_ids:
                    firsts.setdefault(out.request_id, now)
    finally:
        engine.scheduler.schedule = schedule
    return min(firsts.values()) - t0, max(firsts.values()) - t0, computed[0]


def main(argv: list[str] | None = None) -> int:
    from shoal.workers import LLMEngine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    EngineArgs.add_cli_args(p)  # its --seed seeds the prompts
    ns = p.parse_args(argv)
    args = EngineArgs.from_cli_args(ns)
    engine = LLMEngine(args)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    shapes = {"n=1": (1, True), f"n={ns.n}": (ns.n, True), f"{ns.n} requests": (ns.n, False)}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in shapes}
    for i in range(ns.num_iters_warmup + ns.num_iters):
        names = list(shapes)
        for name in names[i % 3 :] + names[: i % 3]:  # each shape first in turn: no order favours one
            n, grouped = shapes[name]
            prompt = [rng.randrange(vocab) for _ in range(ns.input_len)]
            r = measure(engine, prompt, n, ns.output_len, grouped)
            if i >= ns.num_iters_warmup:
                results[name].append(r)
    print(
        f"{engine.model_name}, prompt {ns.input_len} tokens, {ns.output_len} out, "
        f"{ns.num_iters} runs each after {ns.num_iters_warmup} warm-up, {args.num_threads or 'all'} threads"
    )
    print(f"  {'':14} {'TTFT p50':>10} {'last choice p50':>16} {'prompt tokens computed':>23}")
    base = statistics.median(r[0] for r in results["n=1"])
    for name, rs in results.items():
        ttft, last = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        print(
            f"  {name:14} {ttft * 1e3:8.1f} ms {last * 1e3:13.1f} ms {rs[0][2]:23d}   ({ttft / base:.2f}x n=1's TTFT)"
        )
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
