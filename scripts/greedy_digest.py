"""One SHA-256 over the engine's outputs, to show a refactor changed no token.

    .venv/bin/python scripts/greedy_digest.py [--out FILE]

The README's prompts, 64 greedy tokens each, batched and one at a time,
under four engine settings (the default, no CPU kernels, bfloat16 weights,
the torch attention backend); under the torch backend also a request
through a LoRA adapter (random, seeded), a regex-guided one and a seeded
n=2 pair sharing one prefill (the router's parallel sampling, two engine
requests with one parent id). Prints each part's digest and the whole's;
--out writes every output (token ids and text) as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tempfile

PROMPTS = [
    "Name three colours.",
    "Once upon a time",
    "Hi",
    "Hello",
    "The capital of France is",
    "Write a haiku about the sea.",
]
SETTINGS = {
    "default": {},
    "no cpu kernels": {"cpu_kernels": False},
    "bfloat16 weights": {"dtype": "bfloat16"},
    "torch attention": {"attention_backend": "torch"},
}
TOKENS = 64
GUIDED = r"(red|green|blue)(, (red|green|blue)){2}\."


def run_engine(llm, ids: list[int], requests: list[tuple[str, object, str | None]]) -> list[list[int]]:
    """Engine requests (id, params, parent id) on one prompt, run to the end; their token ids in order."""
    import inspect

    engine = llm.engine
    for rid, sp, parent in requests:
        if "request_id" in inspect.signature(engine.add_request).parameters:  # the engine before issue 41
            engine.add_request(rid, ids, sp, parent_request_id=parent)
        else:
            from shoal.proto.messages import GenerateRequest

            engine.add_request(
                GenerateRequest(request_id=rid, prompt_token_ids=ids, params=sp, parent_request_id=parent)
            )
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got[delta.request_id] += delta.new_token_ids
    return [got[rid] for rid, _, _ in requests]


def outputs(setting: str, engine_args: dict, tmp: str) -> list[dict]:
    from shoal.proto.structured_params import StructuredOutputsParams
    from shoal.workers import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=TOKENS)
    rows = []
    extra = dict(enable_lora=True, max_loras=1) if setting == "torch attention" else {}
    with LLM(**engine_args, **extra) as llm:
        for how, got in (
            ("batched", llm.generate(PROMPTS, greedy)),
            ("alone", [llm.generate(p, greedy)[0] for p in PROMPTS]),
        ):
            rows += [{"setting": setting, "how": how, "ids": o.token_ids, "text": o.text} for o in got]
        if not extra:
            return rows
        from shoal.benchmarks.lora import write_adapter
        from shoal.workers.lora import LoRARequest

        path = write_adapter(f"{tmp}/adapter", llm.engine.model_config, 8, seed=3, b_std=0.5)
        o = llm.generate(PROMPTS[1], greedy, lora_request=LoRARequest("digest", 1, path))[0]
        rows.append({"setting": setting, "how": "lora", "ids": o.token_ids, "text": o.text})
        guided = SamplingParams(
            temperature=0, max_tokens=TOKENS, structured_outputs=StructuredOutputsParams(regex=GUIDED)
        )
        o = llm.generate(PROMPTS[0], guided)[0]
        assert re.fullmatch(GUIDED, o.text), f"guided output {o.text!r} is not of {GUIDED}"
        rows.append({"setting": setting, "how": "guided", "ids": o.token_ids, "text": o.text})
        ids = llm.engine.tokenize(PROMPTS[1])
        pair = [(f"n-{k}", SamplingParams(temperature=0.8, seed=7 + k, max_tokens=TOKENS), "n-0") for k in range(2)]
        for k, got in enumerate(run_engine(llm, ids, pair)):
            rows.append({"setting": setting, "how": f"n=2 sample {k}", "ids": got, "text": llm.tokenizer.decode(got)})
    return rows


def digest(rows: list[dict]) -> str:
    return hashlib.sha256("\n".join(json.dumps(r, sort_keys=True) for r in rows).encode()).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write every output as JSON lines")
    ns = p.parse_args()
    every = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting, engine_args in SETTINGS.items():
            rows = outputs(setting, engine_args, tmp)
            print(f"{setting:18} {len(rows):3} outputs  {digest(rows)}", flush=True)
            every += rows
    if ns.out:
        with open(ns.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in every)
    print(f"{'all':18} {len(every):3} outputs  {digest(every)}")


if __name__ == "__main__":
    main()
