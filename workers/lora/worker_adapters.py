"""The adapters a worker serves by name: those of --lora-modules and those
loaded at run time (the router's /v1/load_lora_adapter, kept in the
application's registry for the workers that start later).

An adapter that cannot be read here, at start or later (its files gone,
unreadable, or changed since it was loaded), does not stop the worker: it
is logged, reported unavailable here (WorkerLoad.loras: LORA_UNAVAILABLE,
which the routers read to send its requests to a worker that has it), and
its requests that still land here are refused (404). An unload, then a
load, takes it up again.

Runtime loads are checked twice over: their path must resolve inside
--lora-root when one is set (os.path.realpath: no symlink or `..` leads
out), else 403; and at most --max-runtime-loras of them are served, past
which a load is refused (409). A client never learns from an answer
whether a path exists (files.public_message): the detail goes to the log.
"""

from __future__ import annotations

import asyncio
import logging

from shoal.proto.errors import InvalidRequestError, LoRAAdapterError
from shoal.proto.lora.files import public_message, under_root, within_root
from shoal.proto.lora.modules import LORA_UNAVAILABLE, LoRAModulePath
from shoal.proto.lora.registry import LoRARegistry
from shoal.proto.lora.request import LoRARequest
from shoal.proto.messages import WorkerError

logger = logging.getLogger(__name__)


class WorkerAdapters:
    """engine: the worker's AsyncEngine; root and max_runtime: --lora-root
    and --max-runtime-loras; registry: the application's runtime loads."""

    def __init__(self, engine, worker: str, root: str | None, max_runtime: int, registry: LoRARegistry | None):
        self.engine, self.worker = engine, worker
        self.root, self.max_runtime, self.registry = root or None, max_runtime, registry
        self.static: set[str] = set()  # --lora-modules' names
        self.unavailable: dict[str, int] = {}  # name -> lora_int_id: served elsewhere, unreadable here

    # ---- at start ---------------------------------------------------------------

    def start(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules, then the registry's runtime loads; none that fails stops the worker."""
        for m in modules:
            self.static.add(m.name)
            self._add_at_start(m.name, m.lora_request(), None)
        try:
            entries = self.registry.entries() if self.registry is not None else {}
        except Exception:
            logger.exception("the LoRA registry cannot be read; its adapters load on their first request")
            entries = {}
        for name, entry in entries.items():
            if name in self.static:
                continue
            try:
                request = LoRARequest(name, entry.lora_int_id, under_root(entry.lora_path, self.root))
            except Exception as e:
                self._mark_unavailable(name, 0, e)
                continue
            if not within_root(request.lora_path, self.root):
                self._mark_unavailable(
                    name, request.lora_int_id, ValueError(f"{request.lora_path!r} is outside --lora-root")
                )
                continue
            self._add_at_start(name, request, self.root)

    def _add_at_start(self, name: str, request: LoRARequest, root: str | None) -> None:
        try:
            self.engine.engine.add_named_lora(request, root)
        except Exception as e:  # whatever it is, this adapter alone is out, here
            self._mark_unavailable(name, request.lora_int_id, e)
            return
        logger.info("loaded LoRA adapter %r (id %d)", name, request.lora_int_id)

    def _mark_unavailable(self, name: str, lora_int_id: int, error: BaseException) -> None:
        self.unavailable[name] = lora_int_id
        logger.error(
            "LoRA adapter %r cannot be served on worker %s: %s: %s; it is reported unavailable here "
            "(unload and load it again once its files are fixed)",
            name,
            self.worker,
            type(error).__name__,
            error,
        )

    # ---- what the router reads --------------------------------------------------

    def ids(self) -> dict[str, int]:
        """name -> lora_int_id of every adapter served by name, here or (unavailable) elsewhere."""
        return {name: r.lora_int_id for name, r in list(self.engine.engine.lora_by_name.items())} | self.unavailable

    def where(self, loras: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """The engine's residency report (LLMEngine.lora_stats) with the unavailable ones marked."""
        return loras | {name: (lid, LORA_UNAVAILABLE) for name, lid in list(self.unavailable.items())}

    # ---- a request under an adapter ---------------------------------------------

    async def for_request(self, name: str) -> LoRARequest | WorkerError:
        """The adapter a request names, its tensors in host memory; else the
        refusal: 'not_found' (404) where it is not served, 'invalid' (400)
        where its files changed or went since it was loaded here."""
        if name in self.unavailable:
            return WorkerError("not_found", self._unavailable_message(name), "model")
        held = self.engine.engine.lora_by_name.get(name) or await self._from_registry(name)
        if held is None:
            why = f"LoRA adapter {name!r} is not loaded on worker {self.worker}"
            return WorkerError(
                "not_found", self._unavailable_message(name) if name in self.unavailable else why, "model"
            )
        host = self.engine.engine.lora_host
        if host is not None and host.get(held.lora_int_id) is None:  # evicted: read again off the loop
            try:
                await asyncio.to_thread(self.engine.engine.register_lora, held)
            except InvalidRequestError as e:  # its files changed or went: this adapter is out here
                self._mark_unavailable(name, held.lora_int_id, e)
                return WorkerError("invalid", str(e), "model")
        return held

    def _unavailable_message(self, name: str) -> str:
        return (
            f"LoRA adapter {name!r} is not available on worker {self.worker}: it could not be loaded "
            "there (the worker's log says why)"
        )

    async def _from_registry(self, name: str) -> LoRARequest | None:
        """A request names an adapter not held here: loaded at run time by a
        router while this worker was starting. Loaded now from the registry
        (None: not there, or unreadable here: then unavailable)."""
        if self.registry is None:
            return None
        try:
            entry = await asyncio.to_thread(self.registry.get, name)
        except Exception:
            logger.exception("the LoRA registry cannot be read")
            return None
        if entry is None:
            return None
        error = await self.load(name, entry.lora_path, entry.lora_int_id, capped=False)
        if error is not None and error.kind != "conflict":  # (conflict: a request beside this one loaded it)
            self.unavailable.setdefault(name, entry.lora_int_id)
        return self.engine.engine.lora_by_name.get(name)

    # ---- runtime loads and unloads ----------------------------------------------

    def num_runtime(self) -> int:
        return len((set(self.engine.engine.lora_by_name) | set(self.unavailable)) - self.static)

    async def load(self, name: str, path: str, lora_int_id: int, capped: bool = True) -> WorkerError | None:
        """Serve a peft adapter from `path` as `name` (its files read and
        checked off the event loop). None when done, or when it is loaded here
        already under this id; else a WorkerError: 'invalid' (400),
        'forbidden' (403: outside --lora-root), 'conflict' (409: the name is
        loaded under another id, or --max-runtime-loras are loaded)."""
        held = self.engine.engine.lora_by_name.get(name)
        if held is not None and (held.lora_int_id, held.lora_path) == (lora_int_id, path):
            return None
        if capped and held is None and name not in self.static and self.num_runtime() >= self.max_runtime:
            return WorkerError(
                "conflict",
                f"worker {self.worker}: {self.max_runtime} LoRA adapters are loaded at run time already "
                "(--max-runtime-loras); unload one first",
                "lora_name",
                "lora_limit",
            )
        path = under_root(path, self.root)
        if not within_root(path, self.root):
            logger.warning("LoRA adapter %r refused: %r is outside --lora-root %r", name, path, self.root)
            return WorkerError("forbidden", public_message(name), "lora_path")
        try:
            await self.engine.add_named_lora(LoRARequest(name, lora_int_id, path), self.root)
        except LoRAAdapterError as e:  # (no worker name on a refused path: its message is the same everywhere)
            prefix = "" if e.kind == "forbidden" else f"worker {self.worker}: "
            return WorkerError(e.kind, f"{prefix}{e}", e.field)
        except (InvalidRequestError, ValueError) as e:
            return WorkerError("invalid", str(e), "lora_path")
        except Exception:
            logger.exception("LoRA adapter %r: loading %r failed", name, path)
            return WorkerError("invalid", public_message(name), "lora_path")
        self.unavailable.pop(name, None)
        logger.info("loaded LoRA adapter %r (id %d)", name, lora_int_id)
        return None

    def unload(self, name: str) -> WorkerError | None:
        """Stop serving `name`. None when done; a WorkerError 'not_found', or
        'conflict' while requests under it are here (it stays loaded)."""
        if name in self.unavailable and name not in self.engine.engine.lora_by_name:
            del self.unavailable[name]
            return None
        try:
            self.engine.remove_named_lora(name)
        except LoRAAdapterError as e:
            return WorkerError(e.kind, f"worker {self.worker}: {e}", e.field)
        self.unavailable.pop(name, None)
        self.static.discard(name)
        logger.info("unloaded LoRA adapter %r", name)
        return None
