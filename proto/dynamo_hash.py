"""NVIDIA Dynamo's block hashes, for KV events that a Dynamo or llm-d
router reads (--kv-events-dynamo-hashes). Dynamo names a block's tokens by
XXH3-64 (seed 1337) of the tokens as little-endian u32 (its "local" block
hash, LocalBlockHash) and chains them: a sequence hash is the first
block's local hash, then XXH3-64 of the parent's sequence hash and the
block's local hash, each a little-endian u64. Its test vector:
compute_block_hash(b"test data") = 13226331709069118873.

shoal's own keys (block_hash.py) stay SHA-256: these are only emitted
beside them. LoRA adapters and cache salts are not in Dynamo's default
hash: events of such blocks carry none (a Dynamo indexer must not match
them against the base model's)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

XXH3_SEED = 1337


def _xxh3_64(data: bytes) -> int:
    try:
        import xxhash
    except ImportError:  # the optional dependency: pip install 'shoal[dynamo]'
        raise ValueError("Dynamo block hashes need the xxhash package: pip install xxhash") from None
    return int(xxhash.xxh3_64_intdigest(data, seed=XXH3_SEED))


def check_available() -> None:
    """Raises ValueError, naming the package, if the hashes cannot be made here."""
    _xxh3_64(b"")


def compute_block_hash(data: bytes) -> int:
    """Dynamo's compute_block_hash: XXH3-64 of data, seed 1337."""
    return _xxh3_64(data)


def local_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The local hash of each full block of token_ids (a partial last block has none)."""
    n = len(token_ids) // block_size
    return [
        _xxh3_64(struct.pack(f"<{block_size}I", *token_ids[i * block_size : (i + 1) * block_size])) for i in range(n)
    ]


def sequence_hashes(local: Sequence[int], parent: int | None = None) -> list[int]:
    """The rolling sequence hash of each block, from its parent's (None: the chain starts here)."""
    out = []
    for h in local:
        parent = h if parent is None else _xxh3_64(struct.pack("<QQ", parent, h))
        out.append(parent)
    return out
