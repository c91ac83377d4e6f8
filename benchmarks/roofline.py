"""`shoal bench roofline`: this machine's peak for each arithmetic a CPU
multiplies in (float32 FMA, int8 and bfloat16 dot products), and a run's
share of the peak of the arithmetic it used (`bench offline`).

Each peak is a loop of one instruction over independent accumulators on
every thread, with nothing else in it (csrc/roofline.cpp, built alone as
shoal_roofline): each path the CPU may have is timed (vfmadd231ps ymm and
zmm; vpmaddubsw+vpmaddwd, the AVX2 int8 GEMMs' sequence, and vpdpbusd under
AVX-VNNI or AVX512-VNNI; vdpbf16ps; AMX tiles), and an arithmetic's peak is
its fastest path. A path the CPU lacks is reported absent, with why. The
rate is ops / s, 2 ops a multiply-add, at its best over a few windows,
counted per CPU second of the loop's threads: on a machine shared with
other work, wall time understates what the cores do (the best wall rate is
kept beside it). Beside each peak the rate a real GEMM reached, where the
caller measured one (torch's float32 matmul, the GGUF Q8_0 kernel).

A run's share: 2 x parameters x tokens (prompt and output) over its seconds,
over the peak of its arithmetic: its result's "compute_dtype" where given,
else int8 under --quantization gguf or int8, else float32. Where this CPU
has no bfloat16 arithmetic (or the arithmetic is one without a peak here),
the share is against the float32 peak, and says so.
"""

from __future__ import annotations

import json
import os
import time

ARITHMETICS = ("float32", "int8", "bfloat16")
INTEGER_METHODS = ("gguf", "int8")  # whose matmuls are integer dot products on the CPU
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "i8": "int8", "uint8": "int8"}
MKL_F32 = "torch float32 matmul (MKL), 2048^3"
Q8_0_GEMM = "GGUF Q8_0 kernel, 256 x 2048 x 2048"


def _window_rates(run_once, ops: float, seconds: float, windows: int) -> tuple[float, float]:
    """(best wall ops/s over `windows` windows, best ops/s per CPU second of its threads over every call).
    run_once() runs the loop once and returns each thread's CPU seconds."""
    run_once()  # warm: the pool's threads up, the clocks raised
    best_wall = best_cpu = 0.0
    for _ in range(windows):
        calls, t0 = 0, time.perf_counter()
        while True:
            cpu = run_once()
            calls += 1
            # each thread did ops / len(cpu) of the work
            best_cpu = max(best_cpu, sum(ops / len(cpu) / max(c, 1e-9) for c in cpu))
            if time.perf_counter() - t0 >= seconds / windows:
                break
        best_wall = max(best_wall, ops * calls / (time.perf_counter() - t0))
    return best_wall, best_cpu


def _calibrated_iters(kernel, name: str, threads: int, target_s: float) -> int:
    """Loop trips that take about target_s of one thread's CPU time."""
    iters = 1024
    while True:
        _, cpu = kernel.run(name, iters, threads)
        took = max(cpu)
        if took >= target_s / 4 or iters >= 1 << 40:
            return max(1, int(iters * target_s / max(took, 1e-9)))
        iters *= 8


def measure_path(kernel, path: dict, threads: int, seconds: float = 0.6, windows: int = 3) -> dict:
    """One present path's rates on `threads` threads."""
    iters = _calibrated_iters(kernel, path["name"], threads, min(0.05, seconds / windows / 2))
    ops = path["ops_per_iter"] * iters * threads
    wall, cpu = _window_rates(lambda: kernel.run(path["name"], iters, threads)[1], ops, seconds, windows)
    return {"ops_s": cpu, "wall_ops_s": wall, "instruction": path["instruction"]}


def _settle(entry: dict) -> None:
    """The arithmetic's peak: its fastest path, never below a real GEMM's rate (a roofline a GEMM beats is
    no roofline: the loop missed something); with neither, absent."""
    best = max(
        ((n, p) for n, p in entry["paths"].items() if p.get("ops_s")), key=lambda np: np[1]["ops_s"], default=None
    )
    achieved = (entry.get("achieved") or {}).get("ops_s")
    if best is not None:
        entry |= {"ops_s": best[1]["ops_s"], "wall_ops_s": best[1]["wall_ops_s"], "path": best[0]}
        entry["instruction"] = best[1]["instruction"]
    if achieved and achieved > (entry.get("ops_s") or 0):
        entry |= {"ops_s": achieved, "wall_ops_s": entry["achieved"]["wall_ops_s"], "path": "achieved"}
        entry["instruction"] = entry["achieved"]["by"] + (" (above every loop here)" if best else "")
    if not entry.get("ops_s"):
        why = "; ".join(p["absent"] for p in entry["paths"].values() if p.get("absent")) or "no loop for it here"
        entry |= {"ops_s": None, "instruction": None, "absent": why}


def measure_rooflines(
    threads: int | None = None, seconds: float = 0.6, achieved: dict[str, dict] | None = None
) -> dict[str, dict]:
    """Each arithmetic's peak on `threads` threads (default: torch's), as
    {arithmetic: {ops_s, wall_ops_s, instruction, path, threads, paths: {path: rates or {absent: why}},
    achieved}}; ops_s None (and absent: why) where this CPU has no path for it. `achieved`: what real
    GEMMs reached (measure_gemms), kept beside the peaks."""
    import torch

    from shoal.workers.model_executor.platforms.cpu import roofline_kernels

    threads = threads or torch.get_num_threads()
    kernel = roofline_kernels.load()
    out = {a: {"threads": threads, "paths": {}} for a in ARITHMETICS}
    for arith, got in (achieved or {}).items():
        if arith in out and got.get("ops_s"):
            out[arith]["achieved"] = got
    if kernel is None:
        for entry in out.values():
            entry["paths"]["any"] = {"absent": "the roofline kernels could not be built here"}
    else:
        for path in kernel.paths():
            entry = out[path["arithmetic"]]["paths"]
            if path["present"]:
                entry[path["name"]] = measure_path(kernel, path, threads, seconds)
            else:
                entry[path["name"]] = {"absent": path["absent"], "instruction": path["instruction"]}
    for entry in out.values():
        _settle(entry)
    return out


def arithmetic_of(result: dict) -> str:
    """The arithmetic a run multiplied in: its compute_dtype where given, else int8 under an integer
    quantization, else float32."""
    dtype = result.get("compute_dtype")
    if dtype:
        name = str(dtype).removeprefix("torch.").lower()
        return _ALIASES.get(name, name)
    return "int8" if result.get("quantization") in INTEGER_METHODS else "float32"


def roofline_share(result: dict, ops: float, rooflines: dict[str, dict]) -> dict:
    """The run's share of its arithmetic's peak: {arithmetic, against (the peak's arithmetic: float32 where
    its own has none here), peak_ops_s, instruction, fraction (None without any peak)}."""
    arith = arithmetic_of(result)
    against = arith if (rooflines.get(arith) or {}).get("ops_s") else "float32"
    roof = rooflines.get(against) or {}
    peak = roof.get("ops_s")
    return {
        "arithmetic": arith,
        "against": against,
        "peak_ops_s": peak,
        "instruction": roof.get("instruction"),
        "fraction": ops / result["seconds"] / peak if peak else None,
    }


def share_label(share: dict) -> str:
    """'int8', or 'bfloat16 vs float32' where its own arithmetic has no peak here."""
    a = share["arithmetic"]
    return a if share["against"] == a else f"{a} vs {share['against']}"


def format_share(share: dict) -> str:
    """'83.1% int8', the percentage of the peak and its arithmetic."""
    f = share.get("fraction")
    return f"{'-' if f is None else f'{100 * f:.1f}%'} {share_label(share)}"


def format_rooflines(rooflines: dict[str, dict], every_path: bool = False) -> str:
    """The rooflines as a table: each arithmetic's peak, its instruction, and the real GEMM's rate beside it."""
    if not rooflines:
        return "rooflines: none measured"
    threads = next(iter(rooflines.values()))["threads"]
    lines = [
        f"rooflines, {threads} thread{'s' if threads != 1 else ''} (GOP/s, 2 ops a multiply-add; per CPU second "
        "of the threads, wall: the best window; GEMM: what a real one reached, likewise):",
        f"  {'arithmetic':<10} {'peak':>8} {'wall':>8}  {'instruction':<46} {'GEMM':>6} {'wall':>6} {'of peak':>7}  "
        "real GEMM",
    ]
    for arith, e in rooflines.items():
        got = e.get("achieved")
        gemm = f"{got['ops_s'] / 1e9:>6.1f} {got['wall_ops_s'] / 1e9:>6.1f}" if got else ""
        if e.get("ops_s") is None:
            lines.append(f"  {arith:<10} absent: {e['absent']}" + (f"; {gemm} {got['by']}" if got else ""))
        else:
            instr = e["instruction"] if e["path"] == "achieved" else f"{e['instruction']} ({e['path']})"
            if got:
                gemm += f" {100 * got['ops_s'] / e['ops_s']:>6.1f}%  {got['by']}"
            lines.append(f"  {arith:<10} {e['ops_s'] / 1e9:>8.1f} {e['wall_ops_s'] / 1e9:>8.1f}  {instr:<46} {gemm}")
        if every_path:
            for name, p in e["paths"].items():
                if p.get("ops_s"):
                    lines.append(
                        f"    {name:<18} {p['ops_s'] / 1e9:>8.1f} {p['wall_ops_s'] / 1e9:>8.1f}  {p['instruction']}"
                    )
                else:
                    lines.append(f"    {name:<18} absent: {p['absent']}")
    return "\n".join(line.rstrip() for line in lines)


def gemm_rates(step, ops: float, threads: int, seconds: float = 2.0, windows: int = 3) -> dict:
    """A real GEMM's rates: the best wall ops/s over `windows` windows (on a shared machine one window swung
    torch's float32 rate from 109 to 177 GFLOP/s), and the best per CPU second of this process over `threads`
    threads, the loops' measure (spinning pool threads count as busy: it errs low)."""
    step()
    best_wall = best_cpu = 0.0
    for _ in range(windows):
        calls, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds / windows:
            step()
            calls += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        best_wall = max(best_wall, ops * calls / wall)
        best_cpu = max(best_cpu, ops * calls * threads / max(cpu, 1e-9))
    return {"ops_s": max(best_cpu, best_wall), "wall_ops_s": best_wall}


def measure_gemms(threads: int, int8: bool = True, seconds: float = 2.0) -> dict[str, dict]:
    """What real GEMMs reach on `threads` torch threads, {arithmetic: {ops_s, wall_ops_s, by}}: torch's
    float32 matmul on 2048 x 2048 matrices, and (int8) the GGUF kernel on Q8_0 blocks, 256 rows by a
    2048 x 2048 matrix (left out without the compiled CPU kernels)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 2048
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = {"float32": gemm_rates(lambda: a @ b, 2 * n**3, threads, seconds) | {"by": MKL_F32}}
        if int8:
            import numpy as np
            from gguf import GGMLQuantizationType
            from gguf.quants import quantize

            from shoal.workers.model_executor.platforms.cpu import kernels as cpu_kernels

            kernels = cpu_kernels.load()
            if kernels is not None:
                m, q8 = 256, GGMLQuantizationType.Q8_0
                w = quantize(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32), q8)
                w, x = kernels.gguf_pack(torch.from_numpy(w), q8), torch.randn(m, n)
                step = lambda: kernels.gguf_linear(x, w, q8, False)  # noqa: E731
                out["int8"] = gemm_rates(step, 2 * m * n * n, threads, seconds) | {"by": Q8_0_GEMM}
        return out
    finally:
        torch.set_num_threads(before)


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="this machine's peak for float32, int8 and bfloat16 arithmetic")
    p.add_argument(
        "--num-threads",
        type=int,
        nargs="+",
        help="thread counts to measure at, each in turn (default: torch's, then 1 if that is more)",
    )
    p.add_argument("--seconds", type=float, default=1.0, help="timing per path and thread count (default: 1.0)")
    p.add_argument(
        "--no-gemm", action="store_true", help="skip the real GEMMs (torch's float32 matmul, the GGUF Q8_0 kernel)"
    )
    p.add_argument("--output", default="bench_results/roofline.json")
    p.set_defaults(func=run)


def run(ns) -> int:
    import torch

    counts = ns.num_threads or sorted({torch.get_num_threads(), 1}, reverse=True)
    if any(n < 1 for n in counts):
        raise ValueError(f"--num-threads takes positive counts; got {counts}")
    if ns.seconds <= 0:
        raise ValueError(f"--seconds must be positive; got {ns.seconds}")
    report = {}
    for n in counts:
        achieved = None if ns.no_gemm else measure_gemms(n)
        report[str(n)] = measure_rooflines(n, ns.seconds, achieved)
        print(format_rooflines(report[str(n)], every_path=True), flush=True)
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump({"threads": report}, f, indent=2)
    print(f"wrote {ns.output}")
    return 0
