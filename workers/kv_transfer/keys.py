"""Keys that survive restarts: a tier stores a block under
SHA-256(fingerprint || prefix-cache key).

The prefix-cache key (proto/block_hash.py) already covers the block's
tokens, everything before them, the LoRA adapter and the cache_salt, and is
derived from constants, never from a process's randomness. The fingerprint
adds what else decides a block's keys and values: the checkpoint, the
tokenizer, the dtypes and quantization the model computes in, the KV cache's
dtype and block size, and the tensor-parallel size (how the heads are
split; each rank stores its own slice under the same key). Two engines share a tier's block only when all of these agree, and
a restarted engine with the same settings finds its blocks again.

The checkpoint is identified by a sampled hash of its files (each file's
name, size, first and last MiB; small files whole), not a full read: a
70B checkpoint would otherwise take minutes to hash at every start, and a
changed checkpoint that kept its size, its first and last MiB is not a
thing that happens by accident.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

_VERSION = b"shoal.kv-tier.v1"
_SAMPLE = 1 << 20  # bytes hashed at each end of a large file
_WHOLE = 8 << 20  # files up to this size are hashed whole (configs, tokenizers)


def _hash_file(h: Any, path: str) -> None:
    size = os.path.getsize(path)
    h.update(os.path.basename(path).encode() + b"\0" + size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= _WHOLE:
            h.update(f.read())
            return
        h.update(f.read(_SAMPLE))
        f.seek(size - _SAMPLE)
        h.update(f.read(_SAMPLE))


def checkpoint_digest(path: str) -> bytes:
    """A .gguf file's, or a folder's files' (not its subfolders'), sampled hash."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        _hash_file(h, path)
    else:
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and not name.startswith("."):
                _hash_file(h, full)
    return h.digest()


def engine_fingerprint(
    checkpoint: bytes,
    *,
    dtype: str,
    weight_dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    block_size: int,
    tp_size: int,
) -> bytes:
    """What a block's contents depend on beyond its prefix-cache key."""
    fields = (dtype, weight_dtype, quantization or "none", kv_cache_dtype, block_size, tp_size)
    return hashlib.sha256(_VERSION + checkpoint + repr(fields).encode()).digest()


def tier_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    """The key a tier stores a block under."""
    return hashlib.sha256(fingerprint + block_hash).digest()
