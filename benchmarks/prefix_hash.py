"""What prefix-cache keys cost per 1,000 prompt tokens (block size 16): the
SHA-256 chain (block_hash.chain_hashes, the router's side), the worker's
shape check of the keys it is sent (adopt_chain), and the Python hash()
chain they replaced, measured in one run.

`python -m shoal.benchmarks.prefix_hash [--tokens 1000] [--block-size 16]`"""

from __future__ import annotations

import argparse
import random
import timeit

from shoal.proto.block_hash import adopt_chain, chain_hashes


def python_hash_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The keys before the SHA-256 chain, as they were computed (hash() of (parent, tokens))."""
    hashes: list[int] = []
    for j in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else 0x5EED_0F_5A0A1
        hashes.append(hash((parent, tuple(token_ids[j * block_size : (j + 1) * block_size]))))
    return hashes


def measure(num_tokens: int = 1000, block_size: int = 16, rounds: int = 60) -> dict[str, float]:
    """Microseconds per call over a num_tokens prompt: the best of `rounds`
    rounds that take turns between the cases (a busy machine slows them alike)."""
    ids = [random.Random(0).randrange(150_000) for _ in range(num_tokens)]
    keys = chain_hashes(ids, block_size)
    cases = {
        "python hash() chain (before)": lambda: python_hash_chain(ids, block_size),
        "sha256 chain (router, once)": lambda: chain_hashes(ids, block_size),
        "adopt_chain (worker's check)": lambda: adopt_chain(keys, num_tokens, block_size),
    }
    n = max(1, 200_000 // max(num_tokens, 1))
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], timeit.timeit(fn, number=n) / n * 1e6)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    for name, us in measure(args.tokens, args.block_size).items():
        print(f"{name:32s} {us:7.1f} us per {args.tokens} prompt tokens (block size {args.block_size})")


if __name__ == "__main__":
    main()
