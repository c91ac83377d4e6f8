"""The prefix-cache hash of a full KV block, shared by the engine and the
router (which scores replicas by how much of a prompt they already hold).

A block's hash chains its parent's hash with its own token ids, so equal
hashes mean equal prefixes. It must be the same in every process: Python
hashes tuples of ints the same everywhere, but hash(None) is an address
before 3.12, so the first block's parent is a fixed number instead.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_PARENT = 0x5EED_0F_5A0A1  # the first block's "parent"


def hash_block(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((ROOT_PARENT if parent is None else parent, token_ids))


def chain_hashes(token_ids: Sequence[int], block_size: int, start: list[int] | None = None) -> list[int]:
    """The hashes of every full block of token_ids; `start` (hashes already
    computed for its first blocks) is extended in place and returned."""
    hashes = start if start is not None else []
    for j in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tuple(token_ids[j * block_size : (j + 1) * block_size])))
    return hashes
