"""`shoal bench structured`: what guided JSON costs a decode step.

For each grammar library (llguidance always, xgrammar where installed) and
two schemas (a typical tool call's arguments, and a 30-property record with
nested arrays), at each batch size: the same prompts run unconstrained
(ignore_eos) and guided (greedy; a reply ends when its JSON does). Each run
is timed per `engine.step()` (so the mask fill, which the engine's own step
timing leaves out, counts) over the decode steps in which every request of
the batch is decoding, matched step for step (the k-th decode step of one
against the k-th of the other: the same batch, the same context lengths).
At a batch of many, each run has its own engine (the guided ones built with
--structured-outputs-backend), a step of each in turn, so that this
machine's drift falls on all alike; engines that do the same work part by a
few percent, so an A/A run (all unconstrained) measures each one's speed
and each ratio is divided by it. At batch 1, where engines part by up to
10%, one engine runs all, in a palindrome order (engine_speeds, palindrome).
The ratio of the mean steps, guided / unconstrained, is printed
beside the goal (1.10x at a batch of many, 1.05x at batch 1), with where the
extra time goes, from the engine's named step ranges (shoal.workers.profiling):
the mask fill (`grammar_bitmask`), staging, the sampler (which applies the
mask) and the matchers' advance (`update_from_output`). Every guided reply
must parse and validate against its schema, and its length in tokens is
printed (a library that lets the model spell a forced key in odd pieces
makes longer replies). Then the compile time per schema (p50/p99 over
--compile-schemas distinct schemas: one property renamed each time, so each
is a cache miss) and what a cache hit costs instead.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.benchmarks.structured_workloads import WORKLOADS, Workload
from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs

GOALS = {1: 1.05}  # batch -> the most a guided step may cost over an unconstrained one
DEFAULT_GOAL = 1.10


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="guided JSON vs unconstrained: step time per grammar library, compile time")
    p.add_argument("--batch-sizes", default="64,1", help="comma-separated batch sizes")
    p.add_argument("--backends", default=None, help="comma-separated: guidance, xgrammar (default: those installed)")
    p.add_argument("--workloads", default="tool call,30 properties", help="comma-separated schema names")
    p.add_argument("--batch1-requests", type=int, default=3, help="batch 1 runs this many requests, one after another")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds of unconstrained and each library")
    p.add_argument("--compile-schemas", type=int, default=40, help="distinct schemas compiled per schema and library")
    p.add_argument("--max-tokens", type=int, default=None, help="override each schema's token cap")
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=64,
        help="tokens of the A/A run that measures each engine's own speed, per batch size over 1 (0: none)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests (batch 4 and 1, 4 schemas)")
    p.add_argument("--output", default="bench_results/structured.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


# ---- the step measurements ------------------------------------------------------------

PARTS = ("grammar_bitmask", "prepare_inputs", "sample", "update_from_output")
FORWARD = "forward"  # the model's pass: the same work guided or not, and nearly all of a step's time


class Wave:
    """Requests added to one engine together, stepped by the caller: it
    times each step in which all of them are decoding (the k-th such step
    under key k) and keeps each reply."""

    def __init__(self, engine, prompts: list[str], params, tag: str):
        self.engine, self.ids = engine, [f"{tag}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(self.ids, prompts):
            engine.add_request(GenerateRequest(rid, engine.tokenize(prompt), params))
        self.started: set[str] = set()
        self.text, self.tokens = dict.fromkeys(self.ids, ""), dict.fromkeys(self.ids, 0)
        self.finish: dict[str, str] = {}
        self.steps: dict[int, tuple[float, dict]] = {}  # k -> (seconds, the step's ranges)

    @property
    def done(self) -> bool:
        return len(self.finish) == len(self.ids)

    def step(self) -> None:
        from shoal.workers import profiling

        full = len(self.started) == len(self.ids) and not self.finish
        profiling.reset()
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        if full:
            self.steps[len(self.steps) + 1] = (dt, profiling.seconds())
        for o in outs:
            self.started.add(o.request_id)
            self.text[o.request_id] += o.new_text
            self.tokens[o.request_id] += len(o.new_token_ids)
            if o.finished:
                self.finish[o.request_id] = o.finish_reason

    def abort(self) -> None:
        for rid in self.ids:
            if rid not in self.finish:
                self.engine.abort_request(rid)


def in_turn(waves: list[Wave], active: Callable[[Wave], bool]) -> None:
    """Step the active waves one after another (who goes first rotates), until none is."""
    turn = 0
    while live := [w for w in waves if active(w)]:
        for w in live[turn % len(live) :] + live[: turn % len(live)]:
            w.step()
        turn += 1


def lockstep(free_engine, guided_engines: dict, prompts: list[str], free_params, guided_params, tag: str):
    """The same prompts unconstrained on one engine and guided on each
    library's own, in turn, so that the machine's drift falls on all alike:
    the unconstrained batch until no guided batch is whole any more (its
    last matched step), the guided ones until their replies end. Returns
    the unconstrained Wave and the guided ones by library."""
    free = Wave(free_engine, prompts, free_params, f"{tag}-free")
    guided = {name: Wave(e, prompts, guided_params, f"{tag}-{name}") for name, e in guided_engines.items()}
    in_turn(
        [free, *guided.values()], lambda w: not w.done and (w is not free or any(not g.finish for g in guided.values()))
    )
    free.abort()
    return free, guided


def palindrome(engine, engines: dict, prompts: list[str], free_params, guided_params, tag: str) -> dict[str, list]:
    """At batch 1, where engines part the most (engine_speeds), all on one
    engine: each library (that engine given the library's manager), the
    unconstrained run twice, each library again in reverse order, so that a
    drift in time falls alike on both sides. An unconstrained run stops at
    the longest guided batch's last matched step. Returns the Waves by name."""
    own, runs = engine.structured_output, {name: [] for name in ["free", *engines]}
    try:
        for i, name in enumerate([*engines, "free", "free", *reversed(engines)]):
            if name == "free":
                need = max(len(w.steps) for n in engines for w in runs[n])
                wave = Wave(engine, prompts, free_params, f"{tag}-{i}-free")
                in_turn([wave], lambda w, need=need: not w.done and len(w.steps) < need)
                wave.abort()
            else:
                engine.structured_output = engines[name].structured_output
                wave = Wave(engine, prompts, guided_params, f"{tag}-{i}-{name}")
                in_turn([wave], lambda w: not w.done)
            runs[name].append(wave)
    finally:
        engine.structured_output = own
    return runs


def engine_speeds(free_engine, engines: dict, batch: int, ns) -> dict[str, float]:
    """An A/A run: the same unconstrained tool-call prompts on every engine,
    in turn; each guided engine's mean step over the free engine's. Engines
    that run the same work part by several percent here (at batch 1 the
    one loaded first is the slowest: where each one's memory sits), so each
    row's ratio is divided by its engine's."""
    from shoal.workers import SamplingParams

    if batch == 1 or not ns.calibration_tokens:  # batch 1 runs all on one engine (palindrome)
        return dict.fromkeys(engines, 1.0)
    prompts = WORKLOADS[0].prompts(free_engine.tokenizer, batch)
    params = SamplingParams(temperature=0, max_tokens=ns.calibration_tokens, ignore_eos=True)
    runs = {n: Wave(e, prompts, params, f"aa-{n}") for n, e in {"free": free_engine, **engines}.items()}
    in_turn(list(runs.values()), lambda wave: not wave.done)
    ks = sorted(set.intersection(*(set(r.steps) for r in runs.values())))
    mean = {n: statistics.fmean(r.steps[k][0] for k in ks) for n, r in runs.items()}
    return {n: mean[n] / mean["free"] for n in engines}


def validate(texts: list[str], schema: dict) -> int:
    """How many replies parse as JSON (strictly: no raw control characters) and validate."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    ok = 0
    for t in texts:
        try:
            value = json.loads(t)
            if jsonschema is not None:
                jsonschema.validate(value, schema)
            ok += 1
        except Exception:
            pass
    return ok


@dataclass
class _Acc:
    """One library's matched steps and replies, over rounds and waves."""

    free: list[float] = field(default_factory=list)
    guided: list[float] = field(default_factory=list)
    free_parts: dict = field(default_factory=lambda: dict.fromkeys((*PARTS, FORWARD), 0.0))
    guided_parts: dict = field(default_factory=lambda: dict.fromkeys((*PARTS, FORWARD), 0.0))
    valid: int = 0
    tokens: list[int] = field(default_factory=list)
    finishes: set = field(default_factory=set)

    def add(self, free: Wave, guided: Wave, schema: dict) -> None:
        ks = sorted(set(free.steps) & set(guided.steps))
        for mine, wave, parts in ((self.free, free, self.free_parts), (self.guided, guided, self.guided_parts)):
            mine += [wave.steps[k][0] for k in ks]
            for p in parts:
                parts[p] += sum(wave.steps[k][1].get(p, 0.0) for k in ks)
        texts = [guided.text[i] for i in guided.ids]
        self.valid += validate(texts, schema)
        self.tokens += [guided.tokens[i] for i in guided.ids]
        self.finishes |= set(guided.finish.values())

    def row(self, speed: float) -> dict:
        """speed: the guided engine's unconstrained step over the free engine's (engine_speeds)."""
        n = len(self.guided)
        free_ms, guided_ms = 1e3 * statistics.fmean(self.free), 1e3 * statistics.fmean(self.guided)
        return {
            "steps": n,
            "unconstrained_ms": free_ms,
            "guided_ms": guided_ms,
            "engine_speed": speed,
            "raw_ratio": guided_ms / free_ms,
            "ratio": guided_ms / free_ms / speed,
            # The median of step-for-step ratios: a burst of other load on the machine moves it less.
            "ratio_p50": statistics.median(g / f for f, g in zip(self.free, self.guided)) / speed,
            # The guided step with the unconstrained run's forward pass in place of its own: all that
            # guiding adds on the host, free of the forward's noise (a few percent from run to run,
            # and from engine to engine), which at batch 1 is the size of the goal itself.
            "host_ratio": (sum(self.guided) - self.guided_parts[FORWARD] + self.free_parts[FORWARD]) / sum(self.free),
            "forward_ms": {
                "unconstrained": 1e3 * self.free_parts[FORWARD] / n,
                "guided": 1e3 * self.guided_parts[FORWARD] / n,
            },
            # Per matched step, guided minus unconstrained (the mask fill is guided's alone).
            "extra_ms": {p: 1e3 * (self.guided_parts[p] - self.free_parts[p]) / n for p in PARTS},
            "valid": self.valid,
            "replies": len(self.tokens),
            "finish_reasons": sorted(self.finishes),
            "reply_tokens": {"min": min(self.tokens), "mean": statistics.fmean(self.tokens), "max": max(self.tokens)},
        }


def measure_steps(free_engine, engines: dict, speeds: dict, work: Workload, batch: int, ns) -> list[dict]:
    """One row per library: matched decode steps, unconstrained against guided
    (the ratio divided by the guided engine's own speed, engine_speeds)."""
    from shoal.proto.structured_params import StructuredOutputsParams
    from shoal.workers import SamplingParams

    max_tokens = ns.max_tokens or work.max_tokens
    schema = work.schema()
    waves = 1 if batch > 1 else ns.batch1_requests
    prompts = work.prompts(free_engine.tokenizer, batch * waves)
    free_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    guided_params = SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema)
    )
    acc = {b: _Acc() for b in engines}
    for r in range(ns.rounds):
        for w in range(waves):
            wave = prompts[w * batch : (w + 1) * batch]
            if batch == 1:
                runs = palindrome(free_engine, engines, wave, free_params, guided_params, f"{r}-{w}")
                for name in engines:
                    for free, g in zip(runs["free"], runs[name]):
                        acc[name].add(free, g, schema)
                continue
            free, guided = lockstep(free_engine, engines, wave, free_params, guided_params, f"{r}-{w}")
            for name, g in guided.items():
                acc[name].add(free, g, schema)
    goal = GOALS.get(batch, DEFAULT_GOAL)
    return [
        {"workload": work.name, "batch": batch, "backend": b, "goal": goal, **a.row(speeds[b])} for b, a in acc.items()
    ]


# ---- compile times ----------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure_compile(manager, work: Workload, n: int) -> dict:
    """Compile n schemas that differ in one property's name (each a miss),
    then ask for each again (each a hit), and start a matcher from one."""
    from shoal.proto.structured_params import StructuredOutputsParams

    manager.compiled(StructuredOutputsParams(json=work.schema("_warmup")))  # the backend's own start, not counted
    specs = [StructuredOutputsParams(json=work.schema(f"_{i}")) for i in range(n)]
    before = manager.num_compiled
    for so in specs:
        manager.compiled(so)
    done = manager.num_compiled - before  # at most the deque's 1024 latest are kept
    compile_s = list(manager.compile_seconds)[len(manager.compile_seconds) - done :]
    hits = manager.num_cache_hits
    hit_s, matcher_s = [], []
    for so in specs:
        t0 = time.perf_counter()
        compiled = manager.compiled(so)
        t1 = time.perf_counter()
        manager.backend.new_grammar(compiled)
        hit_s.append(t1 - t0)
        matcher_s.append(time.perf_counter() - t1)
    assert len(compile_s) == n and manager.num_cache_hits - hits == n  # every first ask compiled, every second hit
    return {
        "workload": work.name,
        "schemas": n,
        "compile_ms": {"p50": 1e3 * statistics.median(compile_s), "p99": 1e3 * _pct(compile_s, 0.99)},
        "cache_hit_ms": {"p50": 1e3 * statistics.median(hit_s), "p99": 1e3 * _pct(hit_s, 0.99)},
        "new_matcher_ms": {"p50": 1e3 * statistics.median(matcher_s), "p99": 1e3 * _pct(matcher_s, 0.99)},
    }


# ---- the command ------------------------------------------------------------------------


def available_backends() -> list[str]:
    return ["guidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") is not None else [])


def print_tables(report: dict) -> None:
    print(
        "\n| schema | batch | library | unconstrained ms/step | guided ms/step | engine A/A | ratio | goal |"
        " step ratio p50 | host ratio | steps | mask fill | staging | sampler | matcher advance | valid JSON |"
        " reply tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["steps"]:
        x = r["extra_ms"]
        t = r["reply_tokens"]

        def mark(ratio: float, goal: float = r["goal"]) -> str:
            return f"{ratio:.3f}x {'ok' if ratio <= goal else 'over'}"

        print(
            f"| {r['workload']} | {r['batch']} | {r['backend']} | {r['unconstrained_ms']:.2f} | {r['guided_ms']:.2f}"
            f" | {r['engine_speed']:.3f} | {mark(r['ratio'])} | {r['goal']:.2f}x | {r['ratio_p50']:.3f}x"
            f" | {mark(r['host_ratio'])} | {r['steps']} | {x['grammar_bitmask']:+.2f} | {x['prepare_inputs']:+.2f}"
            f" | {x['sample']:+.2f} | {x['update_from_output']:+.2f} | {r['valid']}/{r['replies']}"
            f" | {t['min']}-{t['max']} |"
        )
    print(
        "\n(ratio: guided over unconstrained, divided by the guided engine's own speed in the A/A run;"
        " host ratio: the same with the unconstrained run's forward pass in both;"
        " mask fill ... matcher advance: ms per step, guided minus unconstrained)"
    )
    print(f"load average: {report['load_average_at_start']:.2f} at start, {report['load_average_at_end']:.2f} at end")
    print("\n| schema | library | compile p50 | compile p99 | cache hit p50 | new matcher p50 |")
    print("|---|---|---|---|---|---|")
    for c in report["compile"]:
        print(
            f"| {c['workload']} | {c['backend']} | {c['compile_ms']['p50']:.1f} ms | {c['compile_ms']['p99']:.1f} ms"
            f" | {1e3 * c['cache_hit_ms']['p50']:.0f} us | {1e3 * c['new_matcher_ms']['p50']:.0f} us |"
        )


def run(ns) -> int:
    from shoal.workers import LLMEngine, profiling

    if ns.quick:
        ns.batch_sizes, ns.batch1_requests, ns.compile_schemas = "4,1", 1, 4
        ns.max_tokens = ns.max_tokens or 24
        ns.calibration_tokens = min(ns.calibration_tokens, 16)
    backends = ns.backends.split(",") if ns.backends else available_backends()
    names = [w.strip() for w in ns.workloads.split(",")]
    works = [w for w in WORKLOADS if w.name in names]
    if len(works) != len(names) or not set(backends) <= {"guidance", "xgrammar"}:
        raise ValueError(f"workloads are {[w.name for w in WORKLOADS]}, backends guidance and xgrammar")
    args = EngineArgs.from_cli_args(ns)
    t_start = time.perf_counter()
    free_engine = LLMEngine(args)  # the unconstrained runs, stepped in turn with the guided engines'
    engines = {}
    try:
        for b in backends:  # one engine per library, each as --structured-outputs-backend builds it
            engines[b] = LLMEngine(dataclasses.replace(args, structured_outputs_backend=b))
        report = {
            "model": free_engine.model_name,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {free_engine.device}",
            "threads": args.num_threads or os.cpu_count(),
            "load_average_at_start": os.getloadavg()[0],  # other work on the machine skews every figure
            "batch_sizes": [int(b) for b in ns.batch_sizes.split(",")],
            "rounds": ns.rounds,
            "steps": [],
            "compile": [],
        }
        print(f"{free_engine.model_name} on {report['machine']}, libraries: {', '.join(backends)}")
        profiling.enable()
        speeds = {b: engine_speeds(free_engine, engines, b, ns) for b in report["batch_sizes"]}
        report["engine_speeds"] = {str(b): s for b, s in speeds.items()}
        print("engine speeds (A/A, each over the unconstrained engine's):", report["engine_speeds"])
        for work in works:
            for batch in report["batch_sizes"]:
                rows = measure_steps(free_engine, engines, speeds[batch], work, batch, ns)
                for r in rows:
                    print(
                        f"  {work.name}, batch {batch}, {r['backend']}: {r['unconstrained_ms']:.2f} -> "
                        f"{r['guided_ms']:.2f} ms/step ({r['ratio']:.3f}x over {r['steps']} steps), "
                        f"{r['valid']}/{r['replies']} valid"
                    )
                report["steps"] += rows
        profiling.enable(False)
        for work in works:
            for name, engine in engines.items():
                compiled = measure_compile(engine.structured_output, work, ns.compile_schemas)
                report["compile"].append({"backend": name, **compiled})
    finally:
        profiling.enable(False)
        for engine in (free_engine, *engines.values()):
            engine.shutdown()
    report["seconds"] = time.perf_counter() - t_start
    report["load_average_at_end"] = os.getloadavg()[0]
    print_tables(report)
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['seconds']:.0f} s; wrote {ns.output}")
    return 0
