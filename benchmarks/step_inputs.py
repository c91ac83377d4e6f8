"""What staging one step's inputs costs the host, by batch size: the model
runner's `prepare` (token ids, positions, slots, block tables, the
attention metadata and the sampling settings) on the real runner of the
default model, for a step of R decoding sequences and for R decodes beside
one 256-token prompt chunk. Nothing is computed: `prepare` alone, on the
same scheduled batch, repeated.

This is the per-step host work that grows with the batch; at R in the
hundreds (a GPU's batch) it is what keeps a device waiting.

`python -m shoal.benchmarks.step_inputs [--rows 1,16,64,256] [--repeats 200]`"""

from __future__ import annotations

import argparse
import statistics
import time

from shoal.proto.messages import GenerateRequest
from shoal.proto.sampling_params import SamplingParams
from shoal.workers.core.outputs import ModelRunnerOutput
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.engine_args import EngineArgs
from shoal.workers.llm_engine import LLMEngine

_CONTEXT = 200  # prompt tokens of each decoding sequence


def _decoding_batch(engine: LLMEngine, rows: int, prompt_chunk: int) -> SchedulerOutput:
    """A scheduled step of `rows` decodes (plus one prompt chunk of that many
    tokens where prompt_chunk > 0). The prompts are "computed" by the
    scheduler alone, with a stand-in token for each step's output: what
    is timed is staging, which does not read the cache."""
    scheduler = engine.scheduler
    for i in range(rows):
        ids = [(i * 131 + j * 7) % 40000 + 10 for j in range(_CONTEXT)]
        engine.add_request(GenerateRequest(f"r{i}", ids, SamplingParams(max_tokens=1000, ignore_eos=True)))
    for _ in range(rows * _CONTEXT):  # a bound, not a count: a prefill step takes many tokens
        if not scheduler.waiting and all(s.num_computed_tokens >= _CONTEXT for s in scheduler.running):
            break
        sched = scheduler.schedule()
        due = sched.seqs_due_token
        scheduler.update_from_output(sched, ModelRunnerOutput(due, [11] * len(due), [None] * len(due)))
    if prompt_chunk:
        ids = [(j * 13) % 40000 + 10 for j in range(prompt_chunk)]
        engine.add_request(GenerateRequest("prompt", ids, SamplingParams(max_tokens=1)))
    sched = scheduler.schedule()
    n_decodes = sum(1 for _, n in sched.scheduled if n == 1)
    if n_decodes != rows:
        raise RuntimeError(f"scheduled {n_decodes} decodes, wanted {rows}")
    return sched


def _time(engine: LLMEngine, sched: SchedulerOutput, repeats: int) -> float:
    runner = engine.runner
    for _ in range(max(100, repeats // 2)):  # warm: a process's first calls run slower (caches, clocks)
        runner.prepare(sched)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.prepare(sched)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m shoal.benchmarks.step_inputs")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--prompt-chunk", type=int, default=256)
    args = ap.parse_args(argv)
    print("rows  step                              prepare (us)   us a row")
    rows_list = [int(r) for r in args.rows.split(",")]
    engine = LLMEngine(
        EngineArgs(max_num_seqs=max(rows_list) + 1, max_num_batched_tokens=8192, kv_cache_memory_bytes=4 << 30)
    )
    try:
        cases = [(rows, chunk) for rows in rows_list for chunk in (0, args.prompt_chunk)]
        for rows, chunk in cases:
            for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                engine.abort_request(seq.request_id)
            sched = _decoding_batch(engine, rows, chunk)
            t = _time(engine, sched, args.repeats)
            what = f"{rows} decodes" + (f" + {chunk}-token chunk" if chunk else "")
            print(f"{rows:>4}  {what:<32} {t * 1e6:>12.1f} {t * 1e6 / rows:>10.2f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
