"""The workloads of `shoal bench offline` (offline.py runs them): pure
Python, no torch, no model.

A workload is a list of (prompt token ids, output length) pairs, seeded:
random token ids with lengths uniform in a range, outputs uniform in a
range (the requests ignore eos). A preset may start every prompt with one
shared system prompt of random ids, as a chat service's requests do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_prompts: int
    input_len: tuple[int, int]  # the prompt's own part, after any shared prefix
    output_len: tuple[int, int]
    shared_prefix: int = 0  # tokens of the one system prompt every prompt starts with


PRESETS = {
    w.name: w
    for w in (
        Workload("default", 64, (32, 512), (32, 256)),
        Workload("short", 256, (16, 128), (16, 64)),
        Workload("long", 16, (1024, 2048), (128, 512)),
        Workload("chat", 64, (16, 128), (32, 256), shared_prefix=300),
    )
}


def make_workload(
    n: int, seed: int, input_len, output_len, vocab: int, shared_prefix: int = 0
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Drawn first, and nothing drawn without one, so `default` is the same seed for seed as before presets.
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    work = []
    for _ in range(n):
        plen = rng.randint(*input_len)
        work.append((prefix + [rng.randrange(vocab) for _ in range(plen)], rng.randint(*output_len)))
    return work
