"""Pin llama.cpp's view of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
for shoal's GGUF path to be checked against:

    .venv/bin/python scripts/pin_llamacpp_reference.py   # writes tests/data/llamacpp_smollm2_q4_1.json

llama.cpp (llama-cpp-python) on one thread, on the very file shoal serves.
Token ids come from shoal's own tokenizer and are fed to llama.cpp directly,
so tokenisation cannot differ. For each of PROMPTS, 64 greedy tokens (the
argmax of the last logits each step, EOS ignored; benchmarks/llamacpp_peer.py's
greedy(), which `shoal bench latency`'s peer runs too); and the perplexity of
TEXT, exp(mean NLL of tokens 1..n-1), from llama.cpp's logits of one batch.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "llamacpp_smollm2_q4_1.json")
NEW_TOKENS = 64

PROMPTS = [
    "The quick brown fox",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
]
# Two more in the chat template the model was tuned on (rendered by shoal).
CHAT_PROMPTS = [
    "What is the boiling point of water at sea level?",
    "Write a haiku about autumn leaves.",
]

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "experimented with machines that a rider could move by pushing against the ground. The first of "
    "these, built in Germany in 1817, had two wheels in line and a wooden frame, but no pedals. Riders "
    "sat on the frame and walked or ran, gliding between steps. Pedals came decades later, attached "
    "directly to the front wheel, and makers soon learned that a larger front wheel carried the rider "
    "farther with each turn of the cranks. This led to the high wheeler, a striking machine with a front "
    "wheel as tall as a man and a tiny wheel behind. It was fast but dangerous, since a small stone in "
    "the road could throw the rider over the handlebars. The safety bicycle of the 1880s solved the "
    "problem with two wheels of equal size and a chain that drove the rear wheel through gears. Air-filled "
    "rubber tyres followed, making the ride smooth and comfortable. Within a few years, millions of people "
    "could travel freely on their own, and the bicycle changed daily life in cities and in the countryside. "
    "It gave workers a cheap way to reach distant jobs, and it gave many women a new sense of independence. "
    "Today, engineers still refine its frame, its brakes and its gears, yet the basic design of the safety "
    "bicycle has hardly changed in more than a century."
)


def machine() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    from shoal.benchmarks import llamacpp_peer as peer
    from shoal.workers.model_executor.loader.model_loader import default_model_path, load_model_files

    if peer.import_llama_cpp() is None:
        print(peer.NOT_INSTALLED)
        return 1
    path = default_model_path()
    tok = load_model_files(None).tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    prompt_ids = [tok.encode(p) for p in PROMPTS + chats]
    text_ids = tok.encode(TEXT)

    llm = peer.load(path, threads=1)
    continuations = [peer.greedy(llm, ids, NEW_TOKENS) for ids in prompt_ids]
    llm.close()
    llm = peer.load(path, threads=1, logits_all=True)
    ppl = peer.perplexity(llm, text_ids)
    llm.close()

    data = {
        "command": "python scripts/pin_llamacpp_reference.py",
        "llama_cpp_python": peer.version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "model": os.path.basename(path),
        "settings": "n_threads=1, n_ctx=2048, prompt as one batch, greedy argmax of the last logits, EOS ignored",
        "new_tokens": NEW_TOKENS,
        "prompts": [
            {"text": p, "chat": i >= len(PROMPTS), "token_ids": ids, "continuation": cont}
            for i, (p, ids, cont) in enumerate(zip(PROMPTS + CHAT_PROMPTS, prompt_ids, continuations))
        ],
        "text": TEXT,
        "text_token_ids": text_ids,
        "perplexity": ppl,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"perplexity {ppl:.4f} over {len(text_ids)} tokens; wrote {OUT}")
    for p, cont in zip(PROMPTS + CHAT_PROMPTS, continuations):
        print(f"  {p!r} -> {tok.decode(cont)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
