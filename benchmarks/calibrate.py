"""`shoal bench calibrate`: the step cost model of load_format "simulated",
fitted to the real engine on this machine.

Times ModelRunner.execute over pure prefills, pure decodes (at several
batch sizes and one long context) and one held-out mixed step, keeping
the fastest of --reps rounds per shape (other load on a shared machine
only slows steps down); fits overhead + per prefill token + per decode
sequence + per decode context token by least squares on relative error,
and prints each shape's fit error. The JSON it writes is what
--simulated-cost-model reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs
from shoal.workers.model_executor.runner.simulated_runner import StepCostModel, StepShape, fit_cost_model


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the simulated worker's step cost model to the real engine here")
    p.add_argument("--reps", type=int, default=5, help="rounds of every shape (the fastest step of each counts)")
    p.add_argument("--output", default="bench_results/step_cost.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, dtype="float32")  # the calibration is of the CPU's float32 engine unless told


def run(ns) -> int:
    import torch

    args = EngineArgs.from_cli_args(ns)
    t0 = time.perf_counter()
    threads = args.num_threads or torch.get_num_threads()
    print(
        f"timing the real engine ({args.model or 'default model'}, {args.dtype}, {args.resolved_device()}, "
        f"{threads} threads, {ns.reps} rounds of every shape) ...",
        flush=True,
    )
    cases = measure_calibration(args, ns.reps, log=lambda line: print(line, file=sys.stderr, flush=True))
    source = (
        f"shoal bench calibrate: {args.model or 'default model'} {args.dtype} on {args.resolved_device()} "
        f"({threads} threads, {os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}"
    )
    model = fit_calibration(cases, source)
    seconds = time.perf_counter() - t0

    print(f"\nstep cost model: {model.describe()}")
    print(f"\n{'shape':<36} {'steps':>5} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    rows = []
    for c in cases:
        predicted = model.step_seconds(c.shape)
        error = predicted / c.seconds - 1
        note = "" if c.fitted else "  (held out)"
        print(
            f"{c.shape.describe():<36} {c.num_steps:>5} {1e3 * c.seconds:>12.1f} {1e3 * predicted:>9.1f} "
            f"{100 * error:>+6.1f}%{note}"
        )
        rows.append(
            {
                "name": c.name,
                "shape": dataclasses.asdict(c.shape),
                "steps": c.num_steps,
                "measured_s": c.seconds,
                "model_s": predicted,
                "error": error,
                "fitted": c.fitted,
            }
        )
    print(f"\ncalibrated in {seconds:.0f} s")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"cost_model": model.to_dict(), "cases": rows, "reps": ns.reps, "seconds": seconds}, f, indent=2)
    print(f"wrote {ns.output} (use it with --load-format simulated --simulated-cost-model {ns.output})")
    return 0


# ---- calibration against the real engine ---------------------------------------

# (prefill tokens,) and (decode batch, context) the calibration runs.
CALIBRATION_PREFILLS = (32, 128, 512)
CALIBRATION_DECODES = ((1, 64), (8, 64), (32, 64), (16, 768))
CALIBRATION_CHECK = (8, 64, 256)  # held out: 8 decodes at context 64 beside a 256-token prefill


@dataclass(slots=True)
class CalibrationCase:
    name: str
    shape: StepShape  # the mean shape of its steps
    seconds: float  # the fastest of its steps: other load on the machine only ever slows a step
    num_steps: int
    fitted: bool = True  # False: held out of the fit, a check of the additive model


def calibrate(engine_args=None, reps: int = 5) -> StepCostModel:
    """The cost model fitted to the real engine on this machine (see measure_calibration)."""
    return fit_calibration(measure_calibration(engine_args, reps))


def fit_calibration(cases: list[CalibrationCase], source: str = "") -> StepCostModel:
    fitted = [c for c in cases if c.fitted]
    return fit_cost_model([c.shape for c in fitted], [c.seconds for c in fitted], source)


def measure_calibration(
    engine_args=None, reps: int = 5, log: Callable[[str], None] | None = None
) -> list[CalibrationCase]:
    """Runs the real engine (engine_args, default: the default model on the
    CPU in float32) over pure prefills, pure decodes and one mixed step, and
    times ModelRunner.execute: the part of a step the simulated runner
    stands in for (the scheduler's own time is spent in both). Every shape
    runs once per round, so a burst of other load on a shared machine slows
    one round of all shapes rather than every step of one; round 0 warms
    the shapes up and is not counted."""
    from shoal.proto.sampling_params import SamplingParams
    from shoal.workers.engine_args import EngineArgs
    from shoal.workers.llm_engine import LLMEngine

    args = engine_args or EngineArgs(device="cpu", dtype="float32")
    max_tokens = 16  # the decode cases' requests are aborted once timed
    longest = max(*CALIBRATION_PREFILLS, *(c for _, c in CALIBRATION_DECODES), CALIBRATION_CHECK[2])
    # A decode case's requests share all but their last prompt token, so a
    # few hundred blocks hold any case; random prompts never hit the prefix cache.
    args = dataclasses.replace(
        args,
        load_format="auto" if args.load_format == "simulated" else args.load_format,
        num_kv_blocks=args.num_kv_blocks or 512,
        max_model_len=args.max_model_len or longest + max_tokens + 1,
    )
    engine = LLMEngine(args)
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    steps: list[tuple[StepShape, float]] = []
    real_execute = engine.runner.execute

    def timed_execute(sched):
        t0 = time.perf_counter()
        out = real_execute(sched)
        steps.append((StepShape.of(sched.scheduled), time.perf_counter() - t0))
        return out

    engine.runner.execute = timed_execute
    ids = iter(range(1 << 30))

    def add(prompt_ids: list[int], n: int) -> str:
        rid = f"cal-{next(ids)}"
        engine.add_request(
            GenerateRequest(rid, prompt_ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        )
        return rid

    def prompt(n: int) -> list[int]:  # random ids: no prefix-cache hits
        return [rng.randrange(vocab) for _ in range(n)]

    def step() -> tuple[StepShape, float]:
        n = len(steps)
        engine.step()
        assert len(steps) == n + 1, "a step ran no model"
        return steps[-1]

    def start_decoding(batch: int, shared: list[int]) -> None:
        """`batch` requests decoding, each `shared` and one token of its own;
        the first is prefilled alone, so the rest find `shared` in the prefix
        cache (as do later rounds)."""
        first = engine.requests[add(shared + prompt(1), max_tokens)].seq
        while first.num_output_tokens == 0:
            step()
        for _ in range(batch - 1):
            add(shared + prompt(1), max_tokens)
        while engine.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            step()

    def abort_all() -> None:
        for rid in list(engine.requests):
            engine.abort_request(rid)

    check_batch, check_context, check_prefill = CALIBRATION_CHECK
    check_name = f"prefill {check_prefill} + decode {check_batch} at ctx {check_context}"
    shared = {(b, c): prompt(c - 1) for b, c in (*CALIBRATION_DECODES, CALIBRATION_CHECK[:2])}
    got: dict[str, list[tuple[StepShape, float]]] = {}
    try:
        for round_ in range(reps + 1):
            timed = []
            for n in CALIBRATION_PREFILLS:
                add(prompt(n), 1)
                timed.append((f"prefill {n}", [step()]))
            for batch, context in CALIBRATION_DECODES:
                start_decoding(batch, shared[batch, context])
                timed.append((f"decode {batch} at ctx {context}", [step(), step()]))
                abort_all()
            start_decoding(check_batch, shared[check_batch, check_context])
            add(prompt(check_prefill), 1)
            timed.append((check_name, [step()]))
            abort_all()
            if round_ > 0:
                for name, s in timed:
                    got.setdefault(name, []).extend(s)
    finally:
        engine.shutdown()
    cases = []
    for name, runs in got.items():
        n = len(runs)
        shape = StepShape(
            *(
                round(sum(getattr(s, f) for s, _ in runs) / n)
                for f in ("prefill_tokens", "decode_seqs", "decode_context_tokens")
            )
        )
        cases.append(CalibrationCase(name, shape, min(t for _, t in runs), n, fitted=name != check_name))
        if log:
            log(
                f"  {name}: {n} steps, fastest {1e3 * cases[-1].seconds:.1f} ms, median "
                f"{1e3 * statistics.median(t for _, t in runs):.1f} ms"
            )
    return cases
