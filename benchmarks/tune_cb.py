"""`shoal bench tune-cb`: how `bench offline`'s CB_SETTINGS were tuned.

It times transformers' continuous batching alone on the first
--num-prompts requests of one workload preset: under the preset's settings,
then under each one-field change that --vary names (one field at a time,
the rest as the preset). A change of page size or requests a step also
grows the cache to hold the step's requests at their longest, as the
presets do, so that no request is evicted and recomputed. The table ranks
them; a setting is worth carrying back to CB_SETTINGS only by a margin
above the run-to-run noise (a few percent here).
"""

from __future__ import annotations

import dataclasses
import json
import os

from shoal.benchmarks.offline import CB_SETTINGS, CBSettings, describe_cb, hf_model, run_hf_cb
from shoal.benchmarks.offline_workloads import PRESETS, Workload, make_workload
from shoal.proto.utils import cdiv
from shoal.workers.engine_args import EngineArgs

INT_FIELDS = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
SCHEDULERS = ("fifo", "prefill_first")


def add_parser(sub) -> None:
    p = sub.add_parser("tune-cb", help="time bench offline's transformers CB peer under other settings")
    p.add_argument("--workload", default="default", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--num-prompts", type=int, help="its first N requests (default: all the preset's)")
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help=f"values to try for one field ({', '.join(INT_FIELDS)}, scheduler_type); repeat for more fields",
    )
    p.add_argument("--output", default="bench_results/tune_cb.json")
    EngineArgs.add_cli_args(p)  # its --seed seeds the workload
    p.set_defaults(func=run)


def pages_needed(w: Workload, s: CBSettings) -> int:
    """Pages that hold a full step of requests at their longest, with a quarter to spare."""
    longest = w.shared_prefix + w.input_len[1] + w.output_len[1]
    return cdiv(5 * s.max_requests_per_batch * cdiv(longest, s.page_size), 4)


def variants(w: Workload, vary: list[str]) -> list[CBSettings]:
    """The preset's settings, then each one-field change of --vary, in order, each once."""
    base = CB_SETTINGS[w.name]
    out = [base]
    for spec in vary:
        field, _, values = spec.partition("=")
        if field not in (*INT_FIELDS, "scheduler_type") or not values:
            raise ValueError(
                f"--vary takes FIELD=V1,V2 with FIELD one of {', '.join(INT_FIELDS)}, scheduler_type; got {spec!r}"
            )
        for v in values.split(","):
            if field == "scheduler_type":
                if v not in SCHEDULERS:
                    raise ValueError(f"--vary scheduler_type takes {', '.join(SCHEDULERS)}; got {v!r}")
                value = v
            else:
                if not v.isdigit() or int(v) < 1:
                    raise ValueError(f"--vary {field} takes positive integers; got {v!r}")
                value = int(v)
            s = dataclasses.replace(base, **{field: value})
            if field != "num_blocks":
                s = dataclasses.replace(s, num_blocks=max(base.num_blocks, pages_needed(w, s)))
            if s not in out:
                out.append(s)
    return out


def run(ns) -> int:
    from shoal.workers.model_executor.loader.model_loader import load_model_files, resolve_model

    if ns.workload not in PRESETS:
        raise ValueError(f"--workload takes one of {', '.join(PRESETS)}; got {ns.workload!r}")
    w = PRESETS[ns.workload]
    w = dataclasses.replace(w, num_prompts=ns.num_prompts or w.num_prompts)
    tries = variants(w, ns.vary)  # bad --vary is refused before the model loads
    args = EngineArgs.from_cli_args(ns)
    vocab = load_model_files(args.model).config.vocab_size
    work = make_workload(w.num_prompts, args.seed, w.input_len, w.output_len, vocab, w.shared_prefix)
    print(
        f"workload {w.name}: the first {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
        f"{sum(n for _, n in work)} output tokens (seed {args.seed})",
        flush=True,
    )
    model = hf_model(resolve_model(args.model), args.resolved_dtype(args.resolved_device()))  # as bench offline's
    results = []
    for s in tries:
        r = run_hf_cb(model, work, s)
        results.append(r)
        print(f"{r['seconds']:8.1f} s  {describe_cb(r['settings'])}", flush=True)
    base = results[0]["seconds"]
    print(f"\n{'seconds':>8} {'vs preset':>9}  transformers CB settings (ranked)")
    for r in sorted(results, key=lambda r: r["seconds"]):
        print(f"{r['seconds']:>8.1f} {r['seconds'] / base:>8.2f}x  {describe_cb(r['settings'])}")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"workload": dataclasses.asdict(w) | {"seed": args.seed}, "results": results}, f, indent=2)
    print(f"wrote {ns.output}")
    return 0
