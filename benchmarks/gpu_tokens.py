"""`shoal bench gpu`, part one: greedy tokens against transformers (float32)
on a real checkpoint, under the scheduler regimes of tests/test_token_exact.py."""

from __future__ import annotations

import math
import random

from shoal.workers.engine_args import EngineArgs

LONGEST_PROMPT = 600
CHUNK = 48  # a prefill budget that splits every long prompt into chunks


def regimes(prompts: list[list[int]], tokens: int, block_size: int) -> dict[str, dict]:
    # Preempting: room for the prompts (and the longest sequence) but not for
    # their outputs, so the running sequences outgrow the cache as they decode.
    blocks = max(
        sum(math.ceil(len(p) / block_size) for p in prompts), math.ceil((max(map(len, prompts)) + tokens) / block_size)
    )
    return {
        "plain": dict(num_kv_blocks=1024),
        "chunked prefill": dict(num_kv_blocks=1024, max_num_batched_tokens=CHUNK),
        "preempting": dict(num_kv_blocks=blocks),
    }


def check_prompts(n: int, vocab: int) -> list[list[int]]:
    """n random prompts with lengths spread over 1..LONGEST_PROMPT, long and short interleaved."""
    rng = random.Random(1)
    lengths = [1 + (LONGEST_PROMPT - 1) * i // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def check_regimes(args: EngineArgs, n_prompts: int, tokens: int, tie_tol: float, report) -> dict[str, dict]:
    """Regime -> {prompts, equal, notes, preemptions, ok} or {error}; `report`
    gets (regime, result) as each ends. ok: every difference is a near-tie
    (transformers' top-2 logit gap under tie_tol, where summation order decides)."""
    import torch

    from shoal.benchmarks.offline import hf_model
    from shoal.benchmarks.tp import first_difference, hf_greedy
    from shoal.workers import LLM, SamplingParams
    from shoal.workers.model_executor.loader.model_loader import resolve_model

    device = args.resolved_device()
    hf = hf_model(resolve_model(args.model), torch.float32).to(device)
    prompts = check_prompts(n_prompts, hf.config.vocab_size)
    refs = hf_greedy(hf, prompts, tokens)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = {}
    for name, kw in regimes(prompts, tokens, args.block_size).items():
        try:
            engine = dict(device=args.device, block_size=args.block_size, num_threads=args.num_threads)
            with LLM(args.model, dtype="float32", cpu_kernels=args.cpu_kernels, **engine, **kw) as llm:
                ours = [o.token_ids for o in llm.generate(prompts, sp)]
                preemptions = llm.engine.stats().num_preemptions
            diffs = [(j, first_difference(hf, *por)) for j, por in enumerate(zip(prompts, ours, refs))]
            diffs = [(j, d) for j, d in diffs if d is not None]
            notes = [
                f"prompt {j} differs at token {i}, top-2 gap {gap:.2e} "
                + ("(near-tie)" if gap < tie_tol else "BEYOND a near-tie")
                for j, (i, gap) in diffs
            ]
            results[name] = {
                "prompts": len(prompts),
                "equal": len(prompts) - len(diffs),
                "notes": notes,
                "preemptions": preemptions,
                "ok": all(gap < tie_tol for _, (_, gap) in diffs),
            }
        except Exception as e:  # one regime's failure leaves the others to run
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        report(name, results[name])
    return results
