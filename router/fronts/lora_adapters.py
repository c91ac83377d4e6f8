"""The LoRA adapters a router serves by name: which `model` names one,
vLLM's runtime load and unload (a broadcast to every worker, kept in the
application's registry for the workers that start later), and the salt of
an adapter's prefix-cache keys.

A runtime load is checked here before any worker is asked, and again by
every worker (workers/lora/worker_adapters.py, which alone sees the files):
its path must resolve inside --lora-root when one is set (403), and at most
--max-runtime-loras adapters are loaded at run time (409). The answer never
says whether a path exists."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from shoal.proto.block_hash import lora_extra
from shoal.proto.lora.files import public_message, under_root, within_root
from shoal.proto.lora.modules import fresh_lora_id
from shoal.proto.lora.registry import LoRARegistry, RuntimeLoRA
from shoal.proto.messages import WorkerError, WorkerLoad
from shoal.router.fronts.serving_error import ServingError
from shoal.router.routing.pool import WorkerPool

logger = logging.getLogger(__name__)
# A model name the router does not know is looked up at the workers (an
# adapter another router loaded) at most this often: unknown names are cheap.
LORA_REFRESH_S = 1.0


class LoRAAdapters:
    """ids: name -> lora_int_id of every adapter served (those at start, those
    loaded through this router, and those the workers report); load: the
    workers' current loads (Frontend.load); root and max_runtime: --lora-root
    and --max-runtime-loras (None: no cap)."""

    def __init__(
        self,
        pool: WorkerPool,
        base_model: str,
        enable_lora: bool,
        ids: dict[str, int],
        load: Callable[[], Awaitable[list[WorkerLoad]]],
        allow_runtime_updating: bool = False,
        registry: LoRARegistry | None = None,
        root: str | None = None,
        max_runtime: int | None = None,
    ):
        self.pool, self.base_model, self.enable_lora = pool, base_model, enable_lora
        self.ids = dict(ids)
        self.root, self.max_runtime = root or None, max_runtime
        self._loaded_here: set[str] = set()  # runtime loads through this router (no registry: the count)
        self._load = load
        self.allow_runtime_updating = allow_runtime_updating
        # Runtime loads are kept there too, for the workers that start later (proto/lora/registry.py).
        self.registry = registry
        self._read_at = float("-inf")

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model);
        a name served nowhere is a 404 naming it."""
        if model is None or model == self.base_model:
            return None
        if model in self.ids:
            return model
        adapters = " and its LoRA adapters (GET /v1/models)" if self.ids else ""
        raise ServingError(
            "not_found",
            f"model {model[:256]!r} is not served here; this server serves {self.base_model!r}{adapters}",
            "model",
        )

    def salt(self, lora_name: str | None) -> bytes:
        """The prefix-cache salt of the adapter's prompts (b"": the base; an adapter unloaded
        meanwhile gets none: its keys then match nothing, and its worker refuses it)."""
        lora_id = None if lora_name is None else self.ids.get(lora_name)
        return b"" if lora_id is None else lora_extra(lora_id)

    async def resolve_model(self, model: str | None) -> str | None:
        """check_model, first asking the workers which adapters they serve when
        `model` is not known here (another router may have loaded it)."""
        if (
            model is not None
            and model != self.base_model
            and model not in self.ids
            and self.enable_lora
            and time.monotonic() - self._read_at >= LORA_REFRESH_S
        ):
            await self.refresh()
        return self.check_model(model)

    async def refresh(self) -> None:
        """The adapters as the workers report them now: those no worker serves go."""
        self._read_at = time.monotonic()
        loads = await self._load()
        if loads:
            self.ids = {name: lid for s in loads for name, (lid, _) in s.loras.items()}

    async def load_adapter(self, name, path) -> None:
        """vLLM's POST /v1/load_lora_adapter: every worker reads and checks the
        adapter at `path` and serves it as `name`, under one fresh id (so the
        router's prefix keys for it match every worker's). Refused: 403 without
        --allow-runtime-lora-updating; 400 for a bad name or adapter (no worker
        keeps it); 409 when the name is served already, or --max-runtime-loras
        are; 403 for a path outside --lora-root (with the message a missing
        or unreadable one gets: the log says which)."""
        self._check_updating()
        for value, field_name in ((name, "lora_name"), (path, "lora_path")):
            if not isinstance(value, str) or not value or len(value) > 4096:
                raise ServingError("invalid", f"{field_name} must be a non-empty string", field_name)
        if len(name) > 256 or name == self.base_model:
            raise ServingError(
                "invalid", "lora_name must be at most 256 characters and not the base model's", "lora_name"
            )
        if "\0" in path:
            raise ServingError("invalid", public_message(name), "lora_path")
        path = under_root(path, self.root)
        if not within_root(path, self.root):
            logger.warning("LoRA adapter %r refused: %r is outside --lora-root %r", name, path, self.root)
            raise ServingError("forbidden", public_message(name), "lora_path")
        await self.refresh()
        if self.max_runtime is not None and name not in self.ids:
            loaded = len(await asyncio.to_thread(self.registry.entries)) if self.registry else len(self._loaded_here)
            if loaded >= self.max_runtime:
                raise ServingError(
                    "conflict",
                    f"{loaded} LoRA adapters are loaded at run time already (--max-runtime-loras "
                    f"{self.max_runtime}); unload one first",
                    "lora_name",
                    "lora_limit",
                )
        lora_id = fresh_lora_id()
        # Registered first, so that a worker starting meanwhile loads it too (or on its first request).
        if name in self.ids or not self._register(name, RuntimeLoRA(path, lora_id)):
            raise ServingError("conflict", f"LoRA adapter {name!r} is loaded already", "lora_name", "lora_loaded")
        results = await self.pool.broadcast("load_lora_adapter", name, path, lora_id)
        errors = [r for r in results if r is not None]
        if errors or not results:
            self._unregister(name)
        if errors and len(errors) < len(results):  # (a worker that read it and another that could not)
            await self.pool.broadcast("unload_lora_adapter", name)
        if not results:
            raise ServingError("unavailable", "no worker is up to load the adapter", code="no_worker")
        if errors:
            raise _from_worker(errors[0], "lora_path")
        self.ids[name] = lora_id
        self._loaded_here.add(name)
        logger.info("LoRA adapter %r loaded on %d workers", name, len(results))

    async def unload_adapter(self, name) -> None:
        """vLLM's POST /v1/unload_lora_adapter: 404 for a name served nowhere;
        409 while requests under it run on a worker (it stays served there:
        unload again once they end)."""
        self._check_updating()
        if not isinstance(name, str) or not name:
            raise ServingError("invalid", "lora_name must be a non-empty string", "lora_name")
        # First ask: an adapter in use on one worker stays served on all of them (a request that
        # lands between the two calls is refused by its worker's unload, which then keeps it).
        in_use = sum(n for n in await self.pool.broadcast("num_lora_requests", name) if isinstance(n, int))
        if in_use:
            raise ServingError(
                "conflict",
                f"LoRA adapter {name!r} is in use by {in_use} request(s); unload it once they end",
                "lora_name",
                "lora_in_use",
            )
        # Out of the registry first, so that no worker starting meanwhile takes it up again.
        registered = self.registry.get(name) if self.registry is not None else None
        self._unregister(name)
        results = await self.pool.broadcast("unload_lora_adapter", name)
        errors = [r for r in results if r is not None]
        conflict = next((e for e in errors if getattr(e, "kind", None) == "conflict"), None)
        if conflict is not None:
            if registered is not None:  # still served where it is in use: kept for the workers to come
                self._register(name, registered)
            raise _from_worker(conflict, "lora_name")
        done = len(results) - len(errors)
        if not done and registered is None:  # (registered, yet loaded nowhere now: it is gone all the same)
            if errors and all(getattr(e, "kind", None) == "not_found" for e in errors):
                self.ids.pop(name, None)
                raise ServingError("not_found", f"no LoRA adapter named {name!r} is loaded", "lora_name")
            if errors:
                raise _from_worker(errors[0], "lora_name")
            raise ServingError("unavailable", "no worker is up to unload the adapter", code="no_worker")
        self.ids.pop(name, None)
        self._loaded_here.discard(name)
        logger.info("LoRA adapter %r unloaded from %d workers", name, done)

    def _register(self, name: str, entry: RuntimeLoRA) -> bool:
        return self.registry is None or self.registry.add(name, entry)

    def _unregister(self, name: str) -> None:
        if self.registry is not None:
            self.registry.remove(name)

    def _check_updating(self) -> None:
        if not self.enable_lora:
            raise ServingError("invalid", "this server was started without --enable-lora", "lora_name")
        if not self.allow_runtime_updating:
            raise ServingError(
                "forbidden",
                "loading and unloading LoRA adapters at run time needs the server started with "
                "--allow-runtime-lora-updating",
            )


def _from_worker(error, field: str) -> ServingError:
    """A worker's answer to a LoRA load or unload (a WorkerError, or what the call raised)."""
    if isinstance(error, WorkerError):
        kind = error.kind if error.kind in ("invalid", "not_found", "conflict", "forbidden") else "internal"
        return ServingError(kind, error.message, error.field or field, error.code)
    return ServingError("unavailable", f"a worker did not answer: {type(error).__name__}", code="worker_failed")
