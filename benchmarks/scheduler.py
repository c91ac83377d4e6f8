"""`shoal bench scheduler`: the scheduler and block manager alone.

A stand-in model returns a token at once, so the time per step is all
bookkeeping: scheduling, block allocation, prefix hashing, the scheduler's
update after the step, and freeing.
"""

from __future__ import annotations

import json
import os
import random
import time

from shoal.workers.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("scheduler", help="ms per step of the scheduler alone")
    p.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--block-size", type=int, default=EngineArgs().block_size)
    p.add_argument(
        "--num-blocks",
        type=int,
        nargs="+",
        default=[50_000, 200_000],
        help="pool sizes; the time per step should not depend on them",
    )
    p.add_argument("--output", default="bench_results/scheduler.json")
    p.set_defaults(func=run)


def measure(num_running: int, steps: int, block_size: int, num_blocks: int, seed: int = 0) -> float:
    """Mean ms per step with `num_running` sequences decoding, each
    replaced by a fresh one (prompt 32..512) when it ends (output 32..256)."""
    from shoal.proto.sampling_params import SamplingParams
    from shoal.workers.core.block_manager import BlockManager
    from shoal.workers.core.outputs import ModelRunnerOutput
    from shoal.workers.core.scheduler import Scheduler, SchedulerConfig
    from shoal.workers.core.sequence import RequestTimings, Sequence

    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)  # unique prompts: no hits, full cost
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=1 << 20, max_num_seqs=num_running),
        bm,
        max_model_len=1 << 20,
        eos_token_ids=[],
    )
    # Prompts are drawn before the clock starts: making them is not the scheduler's work.
    prompts = [[rng.randrange(50_000) for _ in range(rng.randint(32, 512))] for _ in range(num_running * 4)]
    n = 0

    def add():
        nonlocal n
        p = [n] + prompts[n % len(prompts)]  # a unique first token: no prefix-cache hits
        s = Sequence(
            str(n),
            p,
            len(p),
            SamplingParams(max_tokens=rng.randint(32, 256), ignore_eos=True),
            n,
            0,
            RequestTimings(0.0),
        )
        n += 1
        sched.add(s)

    def step():
        out = sched.schedule()
        seqs = out.seqs_due_token  # each gets a made-up token
        tokens = [(s.num_tokens * 13) % 50 for s in seqs]
        for _ in sched.update_from_output(out, ModelRunnerOutput(seqs, tokens, [None] * len(seqs))):
            add()  # keep the number running constant

    for _ in range(num_running):
        add()
    for _ in range(20):  # reach steady state: everyone admitted and decoding
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def run(ns) -> int:
    rows = []
    for nb in ns.num_blocks:
        for r in ns.running:
            rows.append({"running": r, "num_blocks": nb, "ms_per_step": measure(r, ns.steps, ns.block_size, nb)})
    print(f"{'running seqs':>12} {'pool blocks':>12} {'ms / step':>10}")
    for row in rows:
        print(f"{row['running']:>12} {row['num_blocks']:>12} {row['ms_per_step']:>10.3f}")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"block_size": ns.block_size, "steps": ns.steps, "rows": rows}, f, indent=2)
    print(f"wrote {ns.output}")
    return 0
