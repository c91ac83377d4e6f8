"""`shoal bench gpu`'s kv_offload part: the host KV tier on a shape.

- TTFT of a prompt computed against the same prompt loaded from the host
  tier, for each --kv-offload-lens length. A prompt runs once (computed, its
  blocks saved to the host tier), fillers of other tokens then push it out
  of the paged cache, and the prompt runs again: its blocks come back from
  the host tier, all but the last token's.
- decode ms/step with the tier on, beside the decode part's (tier off) at
  the same batch sizes, those the paged cache (sized to the longest prompt)
  holds: the goal is within 2%.
"""

from __future__ import annotations

import dataclasses
import random
import time

from shoal.proto.messages import GenerateRequest
from shoal.proto.utils import cdiv
from shoal.workers.engine_args import EngineArgs

DECODE_GOAL = 1.02  # decode step with offloading on, against off


def _ttft_s(eng, request_id: str, prompt: list[int]) -> float:
    """Seconds to the first token of prompt, alone on the engine, run to its end."""
    from shoal.workers import SamplingParams

    t0 = time.perf_counter()
    eng.add_request(GenerateRequest(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)))
    first = None
    while eng.has_unfinished_requests():
        for d in eng.step():
            if first is None and d.new_token_ids:
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def engine_args(args: EngineArgs, lens: list[int]) -> EngineArgs:
    """A paged cache that holds the longest prompt and little more (so a
    filler evicts it), and a host tier that holds every prompt and filler."""
    from shoal.workers.model_executor.layers.attention.kv_cache import kv_cache_torch_dtype
    from shoal.workers.model_executor.loader.model_loader import load_model_files
    from shoal.workers.model_executor.runner.model_runner import ModelRunner

    bs = args.block_size
    pool = cdiv(max(lens), bs) + 16
    dtype = kv_cache_torch_dtype(args.kv_cache_dtype, args.resolved_dtype(args.resolved_device()))
    per_block = ModelRunner.kv_bytes_per_block(load_model_files(args.model).config, bs, dtype, 1)
    host_blocks = 3 * sum(cdiv(n, bs) + 1 for n in lens) + 2 * pool  # every prompt and filler, written through
    return dataclasses.replace(
        args,
        num_kv_blocks=pool,
        kv_offload_host_bytes=host_blocks * per_block,
        max_model_len=max(args.max_model_len or 0, max(lens) + 64),
    )


def run_kv_offload(args: EngineArgs, ns, batches: list[int], decode: dict | None, name: str, table) -> dict:
    from shoal.benchmarks.tp import decode_step_ms
    from shoal.workers import LLM

    lens = [int(n) for n in ns.kv_offload_lens.split(",") if n]
    args = engine_args(args, lens)
    out: dict = {"ttft": {}, "decode": {}}
    bs = args.block_size
    with LLM(**dataclasses.asdict(args)) as llm:
        eng = llm.engine
        vocab = eng.model_config.vocab_size
        rng = random.Random(0)
        for n in lens:
            prompt = [rng.randrange(vocab) for _ in range(n)]
            fill = args.num_kv_blocks * bs  # in prompts of the longest length at most: the model's limit
            fillers = [
                [rng.randrange(vocab) for _ in range(min(max(lens), fill - i))] for i in range(0, fill, max(lens))
            ]
            _ttft_s(eng, f"warm-up-{n}", [rng.randrange(vocab) for _ in range(n)])  # compiles this length's kernels
            computed = _ttft_s(eng, f"computed-{n}", prompt)
            hits_before = eng.kv_tier_stats()["host"].hit_tokens
            for i, filler in enumerate(fillers):
                _ttft_s(eng, f"filler-{n}-{i}", filler)
            loaded = _ttft_s(eng, f"loaded-{n}", prompt)
            hit = eng.kv_tier_stats()["host"].hit_tokens - hits_before
            r = out["ttft"][n] = {
                "computed_ms": 1000 * computed,
                "loaded_ms": 1000 * loaded,
                "speedup": computed / loaded,
                "host_hit_tokens": hit,
            }
            table.add(
                "kv_offload",
                name,
                f"{n}-token prompt",
                f"TTFT computed {r['computed_ms']:.1f} ms, from the host tier {r['loaded_ms']:.1f} ms "
                f"({r['speedup']:.1f}x; {hit} tokens loaded)",
            )
        fits = [b for b in batches if b * (ns.prompt_len + ns.decode_steps + 2 * bs) <= args.num_kv_blocks * bs]
        for b in fits:  # (a batch past the pool would preempt: not the step the decode part timed)
            ms = decode_step_ms(eng, b, ns.prompt_len, ns.decode_steps, vocab, seed=b)
            off = (decode or {}).get("batches", {}).get(b, {}).get("ms")
            r = out["decode"][b] = {"ms": ms, "off_ms": off, "x_off": None if off is None else ms / off}
            vs = "" if off is None else f"; off {off:.2f} ms, {ms / off:.3f}x (goal <= {DECODE_GOAL})"
            table.add("kv_offload", name, f"decode batch {b}", f"{ms:.2f} ms/step with the tier on{vs}")
    return out
