"""The adapters a server starts with (vLLM's --lora-modules) and the ids
they are served under.

Each entry is `name=path` or a JSON object {"name", "path",
"base_model_name"}. A served adapter's lora_int_id is derived from its name
and path, so every worker (and the router, which salts a LoRA prompt's
prefix-cache keys with it) computes the same id without talking to the
others; an adapter loaded at run time gets a fresh random id from the router
that loads it, so a name reloaded from new files never meets blocks cached
under the old ones.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shoal.proto.lora.request import LoRARequest

# Where a worker holds an adapter (WorkerLoad.loras), cheapest to serve last.
LORA_UNAVAILABLE = -1  # served elsewhere, but its files could not be loaded here: never routed here
LORA_ON_DISK = 0  # registered: its files checked, its weights not in memory
LORA_IN_HOST = 1  # in host memory (--max-cpu-loras): a copy away from a slot
LORA_ON_DEVICE = 2  # in a device slot (--max-loras)


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None

    def lora_request(self, lora_int_id: int | None = None) -> LoRARequest:
        return LoRARequest(
            self.name, lora_int_id or stable_lora_id(self.name, self.path), self.path, self.base_model_name
        )


def stable_lora_id(name: str, path: str) -> int:
    """An id in [1, 2**63) that every process derives alike from (name, path)."""
    digest = hashlib.sha256(name.encode() + b"\0" + path.encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) or 1


def fresh_lora_id() -> int:
    """A runtime-loaded adapter's id: random, so a reload never reuses one."""
    return secrets.randbits(63) or 1


def parse_lora_module(entry: Any) -> LoRAModulePath:
    """One --lora-modules entry: `name=path`, its JSON object form, or (from a
    Serve config or Helm values) that object as a mapping."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules: {entry[:80]!r} is not valid JSON ({e.msg})") from None
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"lora_modules: unknown key {unknown[0]!r} (name, path, base_model_name)")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("lora_modules: base_model_name must be a string")
    elif isinstance(entry, str):
        name, sep, path = entry.partition("=")
        if not sep:
            raise ValueError(f"lora_modules: {entry[:80]!r} is not name=path or a JSON object")
        base = None
    else:
        raise ValueError(f"lora_modules: each entry is name=path or an object, not {type(entry).__name__}")
    if not isinstance(name, str) or not name.strip() or len(name) > 256:
        raise ValueError("lora_modules: name must be a non-empty string of at most 256 characters")
    if not isinstance(path, str) or not path:
        raise ValueError(f"lora_modules: adapter {name!r} needs a path")
    return LoRAModulePath(name.strip(), path, base)


def parse_lora_modules(entries: Iterable[object] | str | dict[str, object] | None) -> list[LoRAModulePath]:
    """Every entry, names unique."""
    if entries is None:
        return []
    if isinstance(entries, str | dict):
        entries = [entries]
    modules = [parse_lora_module(e) for e in entries]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"lora_modules: adapter name {m.name!r} is given twice")
        seen.add(m.name)
    return modules
