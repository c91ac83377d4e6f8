"""vLLM's offline run, executed by the vLLM peer environment's Python (never
imported by shoal: that environment has vllm and no shoal).

    python vllm_driver.py IN.json OUT.json

IN: {"model": HF folder, "dtype": "bfloat16" | "float32", "prompts": [[token
id, ...], ...], "max_tokens": [n, ...], "seed": int, "warmup": k (the first k
prompts run for 4 tokens first, untimed), "engine": {extra LLM(...) keyword
arguments}}. OUT: {"version", "dtype", "load_s", "warmup_s", "seconds" (the
timed generate alone), "output_tokens": [n generated, ...], "outputs": [[token
id, ...], ...], "config": {scheduler sizes vLLM chose}}.

Every request is greedy (temperature 0) with ignore_eos, fed as token ids
(TokensPrompt), so tokenisation cannot differ from shoal's. vLLM starts its
engine core by spawn, which re-imports this file: the work happens under the
main guard only.
"""

from __future__ import annotations

import json
import sys
import time


def _config(llm) -> dict:
    """The scheduler sizes vLLM settled on, where this version exposes them."""
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        cc = llm.llm_engine.vllm_config.cache_config
        return {
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "block_size": cc.block_size,
            "num_gpu_blocks": cc.num_gpu_blocks,
        }
    except AttributeError:
        return {}


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older versions take the same dict
        TokensPrompt = dict  # noqa: N806

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec.get("seed", 0), **spec.get("engine", {}))
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]

    def params(n: int):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    k = spec.get("warmup", 2)
    t0 = time.perf_counter()
    if k:
        llm.generate(prompts[:k], [params(4)] * len(prompts[:k]), use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for n in spec["max_tokens"]], use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "version": vllm.__version__,
        "dtype": spec["dtype"],
        "load_s": load_s,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "config": _config(llm),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
