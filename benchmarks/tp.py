"""`shoal bench tp`: the tensor-parallel check and timing for a GPU machine,
in one command that prints a table (it runs on the CPU too, with gloo).

1. K = 1 greedy output against transformers' generate on the same weights
   (float32, so that only real differences show).
2. Decode step time at several batch sizes for K = 1 and, where the machine
   has the cards (or --device cpu), each larger K that splits the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time

from shoal.proto.messages import GenerateRequest
from shoal.workers.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("tp", help="tensor parallelism: K=1 vs transformers, decode step time per K")
    p.add_argument("--sizes", default="auto", help="comma list of K; auto: 1 and every K the model and cards allow")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--check-tokens", type=int, default=24)
    p.add_argument("--output", default="bench_results/tp.json")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def _sizes(ns, cfg, device: str) -> list[int]:
    import torch

    if ns.sizes != "auto":
        sizes = [int(k) for k in ns.sizes.split(",")]
        for k in sizes:
            cfg.check_tp_size(k)
        return sizes
    cards = torch.cuda.device_count() if device != "cpu" else 4
    sizes = [1]
    for k in range(2, cards + 1):
        try:
            cfg.check_tp_size(k)
            sizes.append(k)
        except ValueError as e:
            print(f"K={k}: skipped ({e})")
    return sizes


def check_against_transformers(ns, prompts: list[list[int]]) -> dict:
    """K = 1 greedy tokens against transformers, one prompt at a time."""
    import torch

    from shoal.benchmarks.offline import hf_model
    from shoal.workers import LLM, SamplingParams
    from shoal.workers.model_executor.loader.model_loader import resolve_model

    device = "cuda" if ns.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    with LLM(ns.model, dtype="float32", device=device, num_kv_blocks=1024) as llm:
        sp = SamplingParams(temperature=0, max_tokens=ns.check_tokens, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, sp)]
    hf = hf_model(resolve_model(ns.model), torch.float32).to(device)
    refs = hf_greedy(hf, prompts, ns.check_tokens)
    equal, notes = 0, []
    for p, got, ref in zip(prompts, ours, refs):
        diff = first_difference(hf, p, got, ref)
        if diff is None:
            equal += 1
        else:
            notes.append(f"differs at token {diff[0]}; transformers' top-2 gap there {diff[1]:.2e}")
    del hf
    return {"prompts": len(prompts), "equal": equal, "notes": notes}


def hf_greedy(hf, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding), exactly `tokens` each."""
    import torch

    device, refs = hf.device, []
    for p in prompts:
        x = torch.tensor([p], device=device)
        with torch.no_grad():
            refs.append(
                hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=tokens,
                    # An id past the vocabulary, never produced: the real EOS is
                    # then an ordinary token, as under ignore_eos. (min_new_tokens
                    # would mask it instead, and generate ignores eos_token_id=None.)
                    eos_token_id=hf.config.vocab_size,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
            )
    return refs


def first_difference(hf, prompt: list[int], ours: list[int], ref: list[int]) -> tuple[int, float] | None:
    """None when equal; else the first differing token and transformers'
    top-2 logit gap there (a near-tie, where summation order decides, when small)."""
    import torch

    if ours == ref:
        return None
    i = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    with torch.no_grad():
        top2 = hf(torch.tensor([prompt + ref[:i]], device=hf.device)).logits[0, -1].float().topk(2).values
    return i, float(top2[0] - top2[1])


def time_decode(ns, k: int, batch: int, vocab: int) -> float:
    """Mean decode step (ms) of `batch` sequences after their prefill."""
    from shoal.workers import LLM

    args = dataclasses.replace(EngineArgs.from_cli_args(ns), tensor_parallel_size=k)
    with LLM(**dataclasses.asdict(args)) as llm:
        return decode_step_ms(llm.engine, batch, ns.prompt_len, ns.decode_steps, vocab, seed=k * 1000 + batch)


def decode_step_ms(eng, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> float:
    """Mean decode step (ms) of `batch` random prompts after their prefill;
    the requests are run to the end, so the engine is idle again after."""
    from shoal.workers import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(GenerateRequest(f"decode-{seed}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], sp))
    while eng.scheduler.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()  # prefill (and a few first decodes)
    for _ in range(4):
        eng.step()  # warm-up
    steps0, sec0 = eng.num_steps, eng.step_seconds
    for _ in range(steps):
        eng.step()
    ms = 1000 * (eng.step_seconds - sec0) / (eng.num_steps - steps0)
    while eng.has_unfinished_requests():
        eng.step()
    return ms


def run(ns) -> int:
    import torch

    from shoal.workers.model_executor.loader.model_loader import load_model_files

    t0 = time.perf_counter()
    cfg = load_model_files(ns.model).config
    device = ("cuda" if torch.cuda.is_available() else "cpu") if ns.device == "auto" else ns.device
    sizes = _sizes(ns, cfg, device)
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(4, 64))] for _ in range(ns.check_prompts)]
    check = check_against_transformers(ns, prompts)
    print(f"K=1 greedy vs transformers (float32): {check['equal']}/{check['prompts']} prompts equal", flush=True)
    for note in check["notes"]:
        print("  " + note)
    batches = [int(b) for b in ns.batch_sizes.split(",")]
    table = {}
    import ray

    if max(sizes) > 1 and not ray.is_initialized():  # one cluster for every K, not one each
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=max(os.cpu_count() or 1, max(sizes)), include_dashboard=False, logging_level="WARNING")
    try:
        for k in sizes:
            for b in batches:
                table[(k, b)] = time_decode(ns, k, b, cfg.vocab_size)
                print(f"K={k} batch {b}: {table[(k, b)]:.2f} ms/step", flush=True)
    finally:
        ray.shutdown()
    print(f"\ndecode step time (ms), {device}, prompt {ns.prompt_len} tokens, dtype {ns.dtype}")
    print(
        f"{'batch':>6} "
        + " ".join(f"{'K=' + str(k):>10}" for k in sizes)
        + "   "
        + " ".join(f"{f'K={k} vs K=1':>12}" for k in sizes[1:])
    )
    for b in batches:
        row = " ".join(f"{table[(k, b)]:>10.2f}" for k in sizes)
        ratios = " ".join(f"{table[(k, b)] / table[(1, b)]:>11.2f}x" for k in sizes[1:])
        print(f"{b:>6} {row}   {ratios}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    os.makedirs(os.path.dirname(ns.output) or ".", exist_ok=True)
    with open(ns.output, "w") as f:
        json.dump(
            {
                "device": device,
                "check": check,
                "sizes": sizes,
                "step_ms": [{"tp": k, "batch": b, "ms": ms} for (k, b), ms in table.items()],
            },
            f,
            indent=2,
        )
    return 0 if check["equal"] == check["prompts"] or all("gap" in n for n in check["notes"]) else 1
