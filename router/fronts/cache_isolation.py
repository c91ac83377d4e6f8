"""Which callers may share prefix-cache blocks (--cache-isolation).

A prompt whose prefix some worker holds is served faster, and its usage
says how much was cached (`prompt_tokens_details.cached_tokens`): a caller
who guesses another's prompt a block at a time can tell a right guess. A
request's cache salt (block_hash.root_key) closes that channel between
salts: only requests with the same salt share any block.

`none`: the client's own cache_salt only (vLLM's behaviour). `key`: the
router folds the caller's identity into every request's salt, so callers
of different identities never share a block, whatever cache_salt they
send. The identity is a hash of the API key the caller authenticated with
(with one key every caller has the same one, so sharing is as under
`none`); a deployment with several keys or tenants gives each its own by
passing `caller` (identity()) to salt().
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)
CACHE_ISOLATION_MODES = ("none", "key")
_IDENTITY = b"shoal.cache-identity.v1\0"
_SALT = b"shoal.cache-salt.v1\0"


def resolve_mode(mode: str | None, api_key: str | None) -> str:
    """The mode a router runs under: unset is `key` when an API key is set, else `none`."""
    if mode is None:
        return "key" if api_key else "none"
    if mode not in CACHE_ISOLATION_MODES:
        raise ValueError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION_MODES)}; got {mode!r}")
    return mode


@dataclass(slots=True, frozen=True)
class CacheIsolation:
    """mode: `none` or `key`; default_caller: the identity of the one API
    key (None: no key, or `none`), every authenticated caller's today."""

    mode: str = "none"
    default_caller: bytes | None = None

    @classmethod
    def build(cls, mode: str | None, api_key: str | None) -> CacheIsolation:
        mode = resolve_mode(mode, api_key)
        if mode == "key" and not api_key:
            logger.warning("--cache-isolation key without an API key: no caller identity to salt with")
        return cls(mode, cls.identity(api_key) if mode == "key" and api_key else None)

    @staticmethod
    def identity(api_key: str) -> bytes:
        """A caller's identity under `key`: a hash of its key (the key itself never leaves the router)."""
        return hashlib.sha256(_IDENTITY + api_key.encode("utf-8", "surrogatepass")).digest()

    def salt(self, cache_salt: str | None, caller: bytes | None = None) -> str | None:
        """The salt a request's keys are made with: the client's (checked
        already), folded with the caller's identity under `key`. A fixed-size
        hex digest, within block_hash's bound whatever the client's length."""
        caller = caller or self.default_caller
        if self.mode != "key" or caller is None:
            return cache_salt
        # A leading byte tells "no client salt" from any salt: the two never fold to one value.
        client = b"\1" if cache_salt is None else b"\0" + cache_salt.encode("utf-8", "surrogatepass")
        return "key:" + hashlib.sha256(_SALT + caller + client).hexdigest()
