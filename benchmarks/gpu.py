"""`shoal bench gpu`: the GPU machine's one command, one table.

1. tokens: greedy tokens against transformers (float32) on --model (the
   default SmolLM2-135M) under three scheduler regimes (gpu_tokens.py).
2. decode: ms/step at several batch sizes against the bandwidth floor,
   weight bytes / the device-to-device copy rate measured at start.
3. offline: the workload of `shoal bench offline` against transformers'
   continuous batching on the same card.
4. kv_offload: TTFT from the host KV tier against computed, and decode with
   the tier on against the decode part's (gpu_kv_offload.py).
Parts 2 to 4 run on each --shapes shape (gpu_shapes.py) with dummy
weights. With --quantization fp8 (or int8) they run twice on each shape,
unquantized and quantized at load, and a speedup row gives the quantized
run's ratios (fp8's goal: decode >= 1.6x at batch 1, offline >= 1.5x); the
token check stays unquantized (its reference is float32). A part that
fails prints its error and the others still run; the exit code is 1 only
when a greedy token differs beyond a near-tie.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time

from shoal.workers.engine_args import EngineArgs

PARTS = ("tokens", "decode", "offline", "kv_offload")
# What --quantization's speed-up is measured against, per shape: batch-1 decode and offline throughput.
GOALS = {"fp8": {"decode": 1.6, "offline": 1.5}}


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="the GPU machine's check: tokens vs transformers, decode vs floor, offline")
    p.add_argument("--shapes", default="smollm2-1.7b,llama-3.1-8b", help="comma list of gpu_shapes.SHAPES")
    p.add_argument("--batch-sizes", default=None, help="comma list (default: each shape's own)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each decode sequence")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the offline workload")
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512], help="offline prompt lengths (uniform)")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], help="offline output lengths (uniform)")
    p.add_argument("--check-prompts", type=int, default=16)
    p.add_argument("--check-tokens", type=int, default=32)
    # Looser than the tests' 1e-4: 30 float32 layers on GPU kernels sum in other orders.
    p.add_argument("--tie-tol", type=float, default=1e-3, help="top-2 logit gap under which a difference is a near-tie")
    p.add_argument(
        "--kv-offload-lens", default="1024,4096,16384", help="comma list of the kv_offload part's prompt lengths"
    )
    p.add_argument("--skip", default="", help=f"comma list of parts to skip: {', '.join(PARTS)}")
    p.add_argument("--output", default="bench_results/gpu.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    """Give back what the last engine or model held before the next loads."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_copy_rate(device, seconds: float = 0.5) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        iters += 1
        _sync(device)
    return 2 * n * iters / (time.perf_counter() - t0)


def _error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


class Table:
    """Rows of (part, model, case, result), each printed as it comes."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, part: str, model: str, case: str, result: str) -> None:
        self.rows.append((part, model, case, result))
        print(f"[{part}] {model} {case}: {result}", flush=True)

    def print(self) -> None:
        print(f"\n{'part':<8} {'model':<22} {'case':<28} result")
        for part, model, case, result in self.rows:
            print(f"{part:<8} {model:<22} {case:<28} {result}")


def run_tokens(ns, table: Table) -> dict:
    from shoal.benchmarks.gpu_tokens import check_regimes
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    args = unquantized(EngineArgs.from_cli_args(ns))
    name = str(args.model or "default model")

    def report(regime: str, r: dict) -> None:
        if "error" in r:
            return table.add("tokens", name, regime, r["error"])
        case = f"{regime} ({r['preemptions']} preemptions)" if regime == "preempting" else regime
        table.add("tokens", name, case, f"{r['equal']}/{r['prompts']} equal" + "".join("; " + n for n in r["notes"]))

    try:
        name = load_model_files(args.model).name
        return check_regimes(args, ns.check_prompts, ns.check_tokens, ns.tie_tol, report)
    except Exception as e:
        table.add("tokens", name, "all", _error(e)["error"])
        return {"all": _error(e)}


def run_decode(args: EngineArgs, ns, batches: list[int], rate: float, name: str, table: Table) -> dict:
    from shoal.benchmarks.tp import decode_step_ms
    from shoal.workers import LLM

    out: dict = {"batches": {}}
    with LLM(**dataclasses.asdict(args)) as llm:
        eng = llm.engine
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
        out["floor_ms"] = 1000 * out["weight_bytes"] / rate  # every weight read once per step
        bm, graphs = eng.block_manager, eng.cuda_graphs
        out["start"] = {
            "load_s": eng.load_time_s,
            "kv_blocks": bm.num_total_blocks,
            "cuda_graphs": None if graphs is None else dataclasses.asdict(graphs),
        }
        kv_gb = (
            bm.num_total_blocks * eng.runner.kv_bytes_per_block(eng.model_config, bm.block_size, eng.runner.dtype) / 1e9
        )
        table.add(
            "start",
            name,
            "engine",
            f"{eng.load_time_s:.1f} s; KV cache {bm.num_total_blocks} blocks "
            f"({kv_gb:.1f} GB); " + ("eager" if graphs is None else graphs.describe()),
        )
        vocab = eng.model_config.vocab_size
        for b in batches:
            try:
                ms = decode_step_ms(eng, b, ns.prompt_len, ns.decode_steps, vocab, seed=b)
            except Exception as e:  # the engine may hold half-run requests now: no more batches on it
                out["batches"][b] = _error(e)
                table.add("decode", name, f"batch {b}", out["batches"][b]["error"])
                break
            out["batches"][b] = {"ms": ms, "x_floor": ms / out["floor_ms"]}
            floor = f"floor {out['floor_ms']:.2f} ms ({out['weight_bytes'] / 1e9:.3g} GB)"
            table.add("decode", name, f"batch {b}", f"{ms:.2f} ms/step; {floor}, {ms / out['floor_ms']:.1f}x")
    return out


def run_offline(args: EngineArgs, ns, folder: str, name: str, table: Table, baseline: bool = True) -> dict:
    """shoal, then (with `baseline`) transformers' continuous batching built
    from the same config (random init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoal.benchmarks.offline import cb_settings_to_fit, make_workload, run_hf_cb, run_shoal
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    vocab = load_model_files(folder).config.vocab_size
    work = make_workload(ns.num_prompts, args.seed, ns.input_len, ns.output_len, vocab)
    n_out = sum(n for _, n in work)
    case = f"{len(work)} requests, {n_out} out"
    out: dict = {"requests": len(work), "output_tokens": n_out}
    try:
        s = run_shoal(args, work)
        out["shoal"] = {k: s[k] for k in ("seconds", "step_ms", "preemptions")}
        out["shoal"]["output_tok_s"] = n_out / s["seconds"]
    except Exception as e:
        out["shoal"] = _error(e)
    _free(args.resolved_device())
    if not baseline:
        r = out["shoal"]
        table.add(
            "offline", name, case, f"shoal {r['error']}" if "error" in r else f"shoal {r['output_tok_s']:.0f} tok/s"
        )
        return out
    try:
        device = args.resolved_device()
        with torch.device(device):  # random init on the card, not on the CPU first
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=args.resolved_dtype(device))
        # On a card transformers sizes its cache from the card's free memory; on the CPU, to the work.
        settings = cb_settings_to_fit(work) if device.type == "cpu" else None
        out["transformers_cb"] = run_hf_cb(hf.eval(), work, settings)
        out["transformers_cb"]["output_tok_s"] = n_out / out["transformers_cb"]["seconds"]
        del hf
    except Exception as e:
        out["transformers_cb"] = _error(e)
    ours, theirs = out["shoal"], out["transformers_cb"]
    result = "; ".join(
        f"{who} {r['error']}" if "error" in r else f"{who} {r['output_tok_s']:.0f} tok/s"
        for who, r in (("shoal", ours), ("transformers CB", theirs))
    )
    if "error" not in ours and "error" not in theirs:
        out["shoal_vs_cb"] = ours["output_tok_s"] / theirs["output_tok_s"]
        result += f"; shoal {out['shoal_vs_cb']:.2f}x"
    table.add("offline", name, case, result)
    return out


def unquantized(args: EngineArgs) -> EngineArgs:
    """The same engine with its weights in the model's dtype: a float
    checkpoint quantized at load (fp8, int8) compares against this."""
    from shoal.workers.model_executor.layers.quantization import ONLINE_METHODS

    return dataclasses.replace(args, quantization="none") if args.quantization in ONLINE_METHODS else args


def modes(base: EngineArgs, dtype: str) -> list[tuple[str, EngineArgs]]:
    """(label, args) of each run of the shapes: one as asked, or under an
    online --quantization the unquantized dtype first, then the quantized."""
    plain = unquantized(base)
    if plain is base:
        return [("", base)]
    return [(dtype, plain), (base.quantization, base)]


def speedups(got: dict, label: str) -> dict:
    """Quantized over unquantized: decode ms/step (per batch) and offline tok/s."""
    out: dict = {}
    fast, slow = got.get(f"decode_{label}", {}).get("batches", {}), got.get("decode", {}).get("batches", {})
    for b, r in fast.items():
        if "ms" in r and "ms" in slow.get(b, {}):
            out[f"decode batch {b}"] = slow[b]["ms"] / r["ms"]
    fast, slow = got.get(f"offline_{label}", {}).get("shoal", {}), got.get("offline", {}).get("shoal", {})
    if "output_tok_s" in fast and "output_tok_s" in slow:
        out["offline"] = fast["output_tok_s"] / slow["output_tok_s"]
    return out


def report_speedups(ratios: dict, label: str, dtype: str, name: str, table: Table) -> None:
    goals = GOALS.get(label, {})
    parts = []
    for case, x in ratios.items():
        goal = goals.get({"offline": "offline", "decode batch 1": "decode"}.get(case, ""))
        parts.append(f"{case} {x:.2f}x" + ("" if goal is None else f" ({'ok' if x >= goal else 'below'} {goal}x)"))
    table.add("speedup", name, f"{label} vs {dtype}", "; ".join(parts) or "nothing to compare")


def run(ns) -> int:
    from shoal.benchmarks.gpu_shapes import shape_folders

    t0 = time.perf_counter()
    skip = {p for p in ns.skip.split(",") if p}
    if skip - set(PARTS):
        raise ValueError(f"--skip takes {', '.join(PARTS)}; got {ns.skip!r}")
    shapes = shape_folders([s for s in ns.shapes.split(",") if s])
    base = EngineArgs.from_cli_args(ns)
    device = base.resolved_device()
    rate = measure_copy_rate(device)
    dtype = str(base.resolved_dtype(device)).removeprefix("torch.")
    print(f"{device}: copy {rate / 1e9:.0f} GB/s (read + write); shapes in {dtype}", flush=True)
    table, report = Table(), {"device": str(device), "copy_bytes_per_s": rate, "dtype": dtype, "shapes": {}}
    if "tokens" not in skip:
        report["tokens"] = run_tokens(ns, table)
        _free(device)
    runs = modes(base, dtype)
    for name, (shape, folder) in shapes.items():
        got = report["shapes"][name] = {}
        for label, mode in runs:
            args = dataclasses.replace(
                mode, model=folder, load_format="dummy", max_model_len=base.max_model_len or shape.max_model_len
            )
            # the first run keeps the plain keys and names; a quantized one is suffixed
            first = label == runs[0][0]
            key, shown = ("", name) if first else (f"_{label}", f"{name} {label}")
            batches = [int(b) for b in ns.batch_sizes.split(",")] if ns.batch_sizes else list(shape.batch_sizes)
            if "decode" not in skip:
                try:
                    got["decode" + key] = run_decode(args, ns, batches, rate, shown, table)
                except Exception as e:
                    got["decode" + key] = _error(e)
                    table.add("decode", shown, "load", got["decode" + key]["error"])
                _free(device)
            if "kv_offload" not in skip and first:  # the host tier in the model's dtype
                from shoal.benchmarks.gpu_kv_offload import run_kv_offload

                try:
                    got["kv_offload"] = run_kv_offload(args, ns, batches, got.get("decode"), shown, table)
                except Exception as e:
                    got["kv_offload"] = _error(e)
                    table.add("kv_offload", shown, "all", got["kv_offload"]["error"])
                _free(device)
            if "offline" not in skip and shape.offline:
                got["offline" + key] = run_offline(args, ns, folder, shown, table, baseline=first)
                _free(device)
        if len(runs) > 1:
            label = runs[1][0]
            got[f"{label}_vs_{dtype}"] = speedups(got, label)
            report_speedups(got[f"{label}_vs_{dtype}"], label, dtype, name, table)
    tokens = report.get("tokens", {})
    report["ok"] = all(r.get("ok", True) for r in tokens.values())  # an error is not a failed check
    table.print()
    print(f"total {time.perf_counter() - t0:.0f} s; greedy tokens {'ok' if report['ok'] else 'FAIL beyond a near-tie'}")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({**report, "rows": table.rows}, f, indent=2)
    print(f"wrote {ns.output}")
    return 0 if report["ok"] else 1
