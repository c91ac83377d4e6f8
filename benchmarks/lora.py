"""`shoal bench lora`: offline throughput with many LoRA adapters against
the base model alone, in one run.

The `default` workload's prompts (benchmarks/offline_workloads.py) go
round-robin over --num-adapters random rank --rank adapters on all seven
projections, through an engine with --enable-lora and --max-loras slots;
then through the same model without LoRA (its fastest path). Printed: each
run's seconds and output tokens/s, the LoRA runs' share of the base's
throughput, and the time spent reading adapters and filling slots. Two
LoRA runs by default: as many adapters as slots (8 of 8), and four times
as many (32 over 8: the slots swap). The goals are 0.85x and 0.7x.

The adapters are written by this bench (adapter_config.json and
adapter_model.safetensors as peft saves them, random A and B of a
realistic scale) into a temporary folder: no peft needed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time

from shoal.workers.engine_args import EngineArgs

GOALS = {"same": 0.85, "swapping": 0.7}  # LoRA throughput over the base's


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="offline throughput with LoRA adapters against the base model")
    p.add_argument("--workload", default="default", help="an offline workload preset (bench offline --workload)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default: the workload's)")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    p.add_argument(
        "--adapters", default="8,32", help="comma list of adapter counts, one LoRA run each (over --max-loras slots)"
    )
    p.add_argument("--output", default="bench_results/lora.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, max_loras=8)


def write_adapter(path: str, config, rank: int, seed: int, b_std: float = 0.02) -> str:
    """A peft-format LoRA adapter of `config`'s shapes with random A and B
    (A ~ U(+-1/sqrt(in)) as peft's kaiming init, B ~ N(0, b_std)); no peft needed."""
    import torch
    from safetensors.torch import save_file

    from shoal.workers.lora.peft_adapter import LINEAR_MODULES, module_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in LINEAR_MODULES:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            bound = 1 / math.sqrt(fan_in)
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=g) * 2 - 1) * bound
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(LINEAR_MODULES), bias="none")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _run(args: EngineArgs, work, loras) -> dict:
    from shoal.workers import LLM, SamplingParams

    with LLM(**dataclasses.asdict(args)) as llm:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.generate([p for p, _ in work[:2]], [warm] * 2, lora_request=loras[:2] if loras else None)
        manager = llm.engine.runner.lora_manager
        load0 = manager.load_seconds if manager else 0.0
        fills0 = manager.num_slot_fills if manager else 0
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, lora_request=loras)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outs)
        out = {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}
        if manager is not None:
            out["adapter_load_s"] = manager.load_seconds - load0
            out["slot_fills"] = manager.num_slot_fills - fills0
            out["waiting_for_a_slot_last_step"] = llm.engine.scheduler.num_waiting_for_lora
    return out


def run(ns) -> int:
    from shoal.benchmarks.offline_workloads import PRESETS, make_workload
    from shoal.workers.lora import LoRARequest
    from shoal.workers.model_executor.loader.model_loader import load_model_files

    args = EngineArgs.from_cli_args(ns)
    preset = PRESETS[ns.workload]
    loaded = load_model_files(args.model)
    n = ns.num_prompts or preset.num_prompts
    work = make_workload(
        n, args.seed, preset.input_len, preset.output_len, loaded.config.vocab_size, preset.shared_prefix
    )
    counts = [int(c) for c in ns.adapters.split(",") if c]
    report: dict = {"model": loaded.name, "workload": ns.workload, "requests": n, "rank": ns.rank, "runs": {}}
    print(f"{loaded.name}: {n} requests ({ns.workload}), adapters of rank {ns.rank}, --max-loras {args.max_loras}")
    base = dataclasses.replace(args, enable_lora=False)
    report["runs"]["base"] = r = _run(base, work, None)
    print(f"  base                 {r['seconds']:7.1f} s  {r['output_tok_s']:7.1f} tok/s")
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            reqs = [
                LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), loaded.config, ns.rank, i))
                for i in range(count)
            ]
            loras = [reqs[i % count] for i in range(n)]
            lora_args = dataclasses.replace(args, enable_lora=True, max_lora_rank=max(args.max_lora_rank, ns.rank))
            r = _run(lora_args, work, loras)
            r["vs_base"] = r["output_tok_s"] / report["runs"]["base"]["output_tok_s"]
            goal = GOALS["same"] if count <= args.max_loras else GOALS["swapping"]
            r["goal"] = goal
            report["runs"][f"{count} adapters"] = r
            print(
                f"  {count:3d} adapters / {args.max_loras} slots ({args.lora_dtype}) {r['seconds']:7.1f} s  {r['output_tok_s']:7.1f} tok/s"
                f"  {r['vs_base']:.2f}x the base (goal {goal}x)  adapters read and slots filled: "
                f"{r['adapter_load_s']:.2f} s over {r['slot_fills']} fills"
            )
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {ns.output}")
    return 0
