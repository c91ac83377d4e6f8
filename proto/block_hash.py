"""The prefix-cache key of a full KV block, shared by the engine and the
router (which scores replicas by how much of a prompt they already hold).

A block's key is SHA-256 of its parent's key, its token ids (little-endian
int64) and an `extra` salt (empty today; the slot for what else changes a
block's contents: a LoRA adapter, a structured-output grammar). So a key
stands for the whole prefix up to the block's end, and a hit on it is a hit
on the whole chain: equal keys mean equal prefixes unless SHA-256 collides.
Python's hash() of tuples did not give that: its collisions are easy to
make offline (vLLM's GHSA-rm76-4mrf-v9r8).

The first block's parent is a fixed constant, not a secret: the router and
every worker must compute the same chain, and a secret would protect
nothing, since what makes a key hard to forge is SHA-256's collision
resistance, and a client probing the cache by timing sends the tokens
themselves, salted or not. The constant names the scheme's version and
the block size, so keys made under another version or block size never
match.

A request's cache_salt (vLLM's field; the router also folds the caller's
identity into it under --cache-isolation key) changes that parent: the
first block's parent is then SHA-256 of another constant, the block size
and the salt, so only requests with the same salt share any block, and a
prompt's `cached_tokens` says nothing of other salts' prompts. Salting the
root costs one hash a prompt; the chain carries it to every later block.

The router hashes each prompt once (chain_hashes) and carries the keys to
the worker (GenerateRequest.block_hashes); the worker takes them after a
shape check (adopt_chain) and hashes only the blocks its output fills.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from shoal.proto.errors import InvalidRequestError

KEY_BYTES = 32  # a key is a SHA-256 digest
MAX_CACHE_SALT_CHARS = 256  # it is hashed once a prompt, but still bounded, as every string a client sends
_VERSION = b"shoal.prefix-cache.sha256.v1"
# Longer than _VERSION + the block size (the unsalted root's input), so no salt gives the unsalted root.
_SALTED = b"shoal.prefix-cache.sha256.v1.salted"
_roots: dict[int, bytes] = {}
_sha256 = hashlib.sha256
_EMPTY = _sha256()  # copying a started hash skips OpenSSL's setup of a new one (~5% of the chain's cost)


def lora_extra(lora_int_id: int) -> bytes:
    """The salt of a prompt's keys under a LoRA adapter: its blocks hold the
    adapter's keys and values, so a prefix cached under another never serves it."""
    return b"lora:" + lora_int_id.to_bytes(8, "little")


def check_cache_salt(cache_salt: object, field: str = "cache_salt") -> None:
    """vLLM's rule (a non-empty string when given) and a length bound; None
    is no salt. The router checks it for a clear 400, the engine again."""
    if cache_salt is None:
        return
    if type(cache_salt) is not str:
        raise InvalidRequestError(f"{field} must be a string, got {type(cache_salt).__name__}", field=field)
    if not cache_salt:
        raise InvalidRequestError(f"{field} must be a non-empty string when given", field=field)
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"{field} has {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed", field=field
        )
    if not cache_salt.isascii():
        try:
            cache_salt.encode()
        except UnicodeEncodeError:  # a lone surrogate (JSON's \ud800): not text
            raise InvalidRequestError(f"{field} must be valid Unicode text", field=field) from None


def root_key(block_size: int, cache_salt: str | None = None) -> bytes:
    """The first block's parent for this block size (and salt, if any)."""
    size = block_size.to_bytes(4, "little")
    if cache_salt:  # not memoized: salts are the clients', and a cache of them would grow without bound
        return _sha256(_SALTED + size + cache_salt.encode("utf-8", "surrogatepass")).digest()
    root = _roots.get(block_size)
    if root is None:
        root = _roots[block_size] = _sha256(_VERSION + size).digest()
    return root


def _pack(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)  # ~4x faster than array/numpy from a list
    except struct.error:
        raise InvalidRequestError("prompt token ids must be integers in the int64 range", field="prompt") from None


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"", cache_salt: str | None = None
) -> bytes:
    """One block's key (parent None: the first block, salted by cache_salt)."""
    p = root_key(len(token_ids), cache_salt) if parent is None else parent
    return _sha256(p + _pack(token_ids) + extra).digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start: list[bytes] | None = None,
    extra: bytes = b"",
    num_blocks: int | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The keys of the full blocks of token_ids (the first `num_blocks` of
    them if given); `start` (keys already computed for its first blocks) is
    extended in place and returned. Only the blocks past `start` are packed
    and hashed. `extra` salts every block (the LoRA adapter); `cache_salt`
    the first one's parent (root_key), and so the whole chain."""
    hashes = start if start is not None else []
    first = len(hashes)
    last = len(token_ids) // block_size if num_blocks is None else min(num_blocks, len(token_ids) // block_size)
    if last <= first:
        return hashes
    data = _pack(token_ids[first * block_size : last * block_size])
    p = hashes[-1] if hashes else root_key(block_size, cache_salt)
    step, new, append = block_size * 8, _EMPTY.copy, hashes.append
    # extra goes last: the parent and the tokens have fixed lengths, so the bytes hashed read only one way.
    for j in range(0, len(data), step):  # (one SHA-256 a block is most of the cost: ~0.3 us)
        h = new()
        h.update(p + data[j : j + step] + extra)
        p = h.digest()
        append(p)
    return hashes


def adopt_chain(hashes: object, num_tokens: int, block_size: int) -> list[bytes]:
    """Keys computed elsewhere (the router's) for the full blocks of a
    prompt of num_tokens, as a fresh list the sequence may extend; or []
    (the engine then hashes the prompt itself) unless they are exactly one
    key per full block.

    The shape is all that is checked, since recomputing would be hashing
    twice. The count catches a router that used another block size (for
    two powers of two the counts differ whenever either is not 0). The
    keys come only from this cluster's routers, over Ray, and a party that
    can forge a worker call can already run code on the cluster."""
    if not isinstance(hashes, list | tuple) or len(hashes) != num_tokens // block_size:
        return []
    for h in hashes:
        if type(h) is not bytes or len(h) != KEY_BYTES:
            return []
    return list(hashes)
