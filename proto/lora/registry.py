"""The adapters loaded at run time (POST /v1/load_lora_adapter), kept where
every router and worker of one application reads them, so that a worker
started later (a scale-up, a replacement) serves them too.

Inside Ray Serve the registry lives in Ray's GCS key-value store, one key
per adapter under the application's name: it lasts as long as the Ray
cluster, across replica restarts and in-place updates of the application.
Elsewhere (tests, one process) it is a dict that the routers and workers are
handed. Adapters named by --lora-modules are not kept here: every worker
reads those from its own options.

No torch and no Ray at import time: the router imports this module, and Ray
is imported only inside a Serve replica, where it is loaded already."""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RuntimeLoRA:
    lora_path: str
    lora_int_id: int


class LoRARegistry(Protocol):
    def add(self, name: str, entry: RuntimeLoRA) -> bool:
        """Keep `entry` under `name`; False (and nothing kept) when the name is taken."""

    def get(self, name: str) -> RuntimeLoRA | None: ...

    def remove(self, name: str) -> None: ...

    def entries(self) -> dict[str, RuntimeLoRA]: ...


class LocalLoRARegistry:
    """name -> RuntimeLoRA, in this process."""

    def __init__(self) -> None:
        self._entries: dict[str, RuntimeLoRA] = {}
        self._lock = threading.Lock()

    def add(self, name: str, entry: RuntimeLoRA) -> bool:
        with self._lock:
            return self._entries.setdefault(name, entry) is entry

    def get(self, name: str) -> RuntimeLoRA | None:
        with self._lock:
            return self._entries.get(name)

    def remove(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def entries(self) -> dict[str, RuntimeLoRA]:
        with self._lock:
            return dict(self._entries)


class GcsLoRARegistry:
    """name -> RuntimeLoRA in Ray's GCS key-value store: namespace `shoal_lora`, key
    `<application>/<adapter name>`, value JSON."""

    NAMESPACE = "shoal_lora"

    def __init__(self, app_name: str):
        from ray.experimental import internal_kv

        self._kv = internal_kv
        self._prefix = f"{app_name}/"

    def add(self, name: str, entry: RuntimeLoRA) -> bool:
        value = json.dumps({"lora_path": entry.lora_path, "lora_int_id": entry.lora_int_id})
        existed = self._kv._internal_kv_put(self._prefix + name, value, overwrite=False, namespace=self.NAMESPACE)
        return not existed

    def get(self, name: str) -> RuntimeLoRA | None:
        value = self._kv._internal_kv_get(self._prefix + name, namespace=self.NAMESPACE)
        return None if value is None else RuntimeLoRA(**json.loads(value))

    def remove(self, name: str) -> None:
        self._kv._internal_kv_del(self._prefix + name, namespace=self.NAMESPACE)

    def entries(self) -> dict[str, RuntimeLoRA]:
        out = {}
        for key in self._kv._internal_kv_list(self._prefix, namespace=self.NAMESPACE):
            name = key.decode()[len(self._prefix) :]
            entry = self.get(name)  # (None: removed since the listing)
            if entry is not None:
                out[name] = entry
        return out


def serve_app_registry() -> LoRARegistry | None:
    """Inside a Serve replica, its application's registry in the GCS; None elsewhere."""
    serve = sys.modules.get("ray.serve")  # imported already inside a Serve replica
    if serve is None:
        return None
    try:
        app_name = serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return None
    return GcsLoRARegistry(app_name)
