"""The router's core, shared by the HTTP and gRPC fronts: check the key,
validate and tokenize, send to a worker, stream its deltas back, drain."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial

from shoal.router.fronts.prompt import Prompt, tokenize
from shoal.router.observability import tracing
from shoal.router.observability.metrics import RouterMetrics
from shoal.router.routing.pool import WorkerPool
from shoal.workers.core.block_hash import chain_hashes, lora_extra
from shoal.workers.core.request_checks import RequestLimits, check_request
from shoal.workers.core.sampling_params import SamplingParams
from shoal.workers.errors import InvalidRequestError
from shoal.workers.lora.modules import fresh_lora_id
from shoal.workers.lora.registry import LoRARegistry, RuntimeLoRA
from shoal.workers.messages import GenerateDelta, GenerateRequest, WorkerError, WorkerInfo, WorkerLoad
from shoal.workers.structured_output.guidance import validate as validate_grammar

logger = logging.getLogger(__name__)
# Bounded: a client's own request id goes into the log lines of its request.
MAX_CLIENT_REQUEST_ID_LEN = 256
# A model name the router does not know is looked up at the workers (an
# adapter another router loaded) at most this often: unknown names are cheap.
LORA_REFRESH_S = 1.0


class ServingError(Exception):
    """kind: invalid (400 / INVALID_ARGUMENT), full (429 / RESOURCE_EXHAUSTED),
    unavailable (503 / UNAVAILABLE), unauthenticated (401 / UNAUTHENTICATED),
    not_found (404 / NOT_FOUND), forbidden (403 / PERMISSION_DENIED),
    conflict (409 / FAILED_PRECONDITION), internal (500 / INTERNAL)."""

    def __init__(self, kind: str, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field
        self.code = code  # a finer reason than the kind's default code


@dataclass(slots=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    tensor_parallel_size: int
    num_workers: int
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_n: int = 16
    grammar_compile_timeout_s: float = 10.0
    enable_lora: bool = False
    max_loras: int = 0
    loras: dict[str, int] = field(default_factory=dict)  # the adapters served at start: name -> lora_int_id

    @classmethod
    def from_worker_info(cls, info: WorkerInfo, num_workers: int) -> ModelInfo:
        return cls(
            info.model,
            info.max_model_len,
            info.vocab_size,
            info.block_size,
            info.tensor_parallel_size,
            num_workers,
            info.max_logprobs,
            info.max_stop_strings,
            info.max_n,
            info.grammar_compile_timeout_s,
            info.enable_lora,
            info.max_loras,
            dict(info.loras),
        )


class Frontend:
    """One per router replica. generate() yields the worker's deltas; the
    last one's `finished` gets the timings measured here."""

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer,
        info: ModelInfo,
        api_key: str | None = None,
        max_prompts: int = 64,
        tokenizer_threads: int = 2,
        allow_runtime_lora_updating: bool = False,
        lora_registry: LoRARegistry | None = None,
    ):
        self.pool, self.tokenizer, self.info = pool, tokenizer, info
        # LoRA adapters served by name -> lora_int_id: those at start, those
        # loaded through this router, and those the workers report.
        self.loras: dict[str, int] = dict(info.loras)
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        # Runtime loads are kept there too, for the workers that start later (workers/lora/registry.py).
        self.lora_registry = lora_registry
        self._loras_read_at = float("-inf")
        self.api_key = api_key or None
        self.max_prompts = max_prompts  # prompts in one completions request
        self.limits = RequestLimits(
            info.vocab_size, info.max_model_len, info.max_logprobs, info.max_stop_strings, info.max_n
        )
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="shoal-tokenize")
        self.metrics = RouterMetrics(info.model, info.max_model_len, info.max_loras)
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- checks -------------------------------------------------------------

    def authenticate(self, presented: str | None) -> None:
        if self.api_key is None:
            return
        if presented is None or not hmac.compare_digest(presented.encode(), self.api_key.encode()):
            raise ServingError("unauthenticated", "a valid API key is required (Authorization: Bearer KEY)")

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model);
        a name served nowhere is a 404 naming it."""
        if model is None or model == self.info.model:
            return None
        if model in self.loras:
            return model
        adapters = " and its LoRA adapters (GET /v1/models)" if self.loras else ""
        raise ServingError(
            "not_found",
            f"model {model[:256]!r} is not served here; this server serves {self.info.model!r}{adapters}",
            "model",
        )

    def _lora_salt(self, lora_name: str | None) -> bytes:
        """The prefix-cache salt of the adapter's prompts (b"": the base; an adapter unloaded
        meanwhile gets none: its keys then match nothing, and its worker refuses it)."""
        lora_id = None if lora_name is None else self.loras.get(lora_name)
        return b"" if lora_id is None else lora_extra(lora_id)

    async def resolve_model(self, model: str | None) -> str | None:
        """check_model, first asking the workers which adapters they serve when
        `model` is not known here (another router may have loaded it)."""
        if (
            model is not None
            and model != self.info.model
            and model not in self.loras
            and self.info.enable_lora
            and time.monotonic() - self._loras_read_at >= LORA_REFRESH_S
        ):
            await self.refresh_loras()
        return self.check_model(model)

    async def refresh_loras(self) -> None:
        """The adapters as the workers report them now: those no worker serves go."""
        self._loras_read_at = time.monotonic()
        loads = await self.load()
        if loads:
            self.loras = {name: lid for s in loads for name, (lid, _) in s.loras.items()}

    async def load_lora_adapter(self, name, path) -> None:
        """vLLM's POST /v1/load_lora_adapter: every worker reads and checks the
        adapter at `path` and serves it as `name`, under one fresh id (so the
        router's prefix keys for it match every worker's). Refused: 403 without
        --allow-runtime-lora-updating; 400 for a bad name or adapter (no worker
        keeps it); 409 when the name is served already."""
        self._check_lora_updating()
        for value, field_name in ((name, "lora_name"), (path, "lora_path")):
            if not isinstance(value, str) or not value or len(value) > 4096:
                raise ServingError("invalid", f"{field_name} must be a non-empty string", field_name)
        if len(name) > 256 or name == self.info.model:
            raise ServingError(
                "invalid", "lora_name must be at most 256 characters and not the base model's", "lora_name"
            )
        await self.refresh_loras()
        lora_id = fresh_lora_id()
        # Registered first, so that a worker starting meanwhile loads it too (or on its first request).
        if name in self.loras or not self._register_lora(name, RuntimeLoRA(path, lora_id)):
            raise ServingError("conflict", f"LoRA adapter {name!r} is loaded already", "lora_name", "lora_loaded")
        results = await self.pool.broadcast("load_lora_adapter", name, path, lora_id)
        errors = [r for r in results if r is not None]
        if errors or not results:
            self._unregister_lora(name)
        if errors and len(errors) < len(results):  # (a worker that read it and another that could not)
            await self.pool.broadcast("unload_lora_adapter", name)
        if not results:
            raise ServingError("unavailable", "no worker is up to load the adapter", code="no_worker")
        if errors:
            raise _from_worker(errors[0], "lora_path")
        self.loras[name] = lora_id
        logger.info("LoRA adapter %r loaded on %d workers", name, len(results))

    async def unload_lora_adapter(self, name) -> None:
        """vLLM's POST /v1/unload_lora_adapter: 404 for a name served nowhere;
        409 while requests under it run on a worker (it stays served there:
        unload again once they end)."""
        self._check_lora_updating()
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
        registered = self.lora_registry.get(name) if self.lora_registry is not None else None
        self._unregister_lora(name)
        results = await self.pool.broadcast("unload_lora_adapter", name)
        errors = [r for r in results if r is not None]
        conflict = next((e for e in errors if getattr(e, "kind", None) == "conflict"), None)
        if conflict is not None:
            if registered is not None:  # still served where it is in use: kept for the workers to come
                self._register_lora(name, registered)
            raise _from_worker(conflict, "lora_name")
        done = len(results) - len(errors)
        if not done and registered is None:  # (registered, yet loaded nowhere now: it is gone all the same)
            if errors and all(getattr(e, "kind", None) == "not_found" for e in errors):
                self.loras.pop(name, None)
                raise ServingError("not_found", f"no LoRA adapter named {name!r} is loaded", "lora_name")
            if errors:
                raise _from_worker(errors[0], "lora_name")
            raise ServingError("unavailable", "no worker is up to unload the adapter", code="no_worker")
        self.loras.pop(name, None)
        logger.info("LoRA adapter %r unloaded from %d workers", name, done)

    def _register_lora(self, name: str, entry: RuntimeLoRA) -> bool:
        return self.lora_registry is None or self.lora_registry.add(name, entry)

    def _unregister_lora(self, name: str) -> None:
        if self.lora_registry is not None:
            self.lora_registry.remove(name)

    def _check_lora_updating(self) -> None:
        if not self.info.enable_lora:
            raise ServingError("invalid", "this server was started without --enable-lora", "lora_name")
        if not self.allow_runtime_lora_updating:
            raise ServingError(
                "forbidden",
                "loading and unloading LoRA adapters at run time needs the server started with "
                "--allow-runtime-lora-updating",
            )

    def client_request_id(self, value: str, field: str) -> str | None:
        """A client's own id for its request (None when it sent none): it is
        echoed and logged beside the engine's id, never used as a key."""
        if len(value) > MAX_CLIENT_REQUEST_ID_LEN:
            raise ServingError(
                "invalid",
                f"{field} has {len(value)} characters; at most {MAX_CLIENT_REQUEST_ID_LEN} are allowed",
                field=field,
            )
        return value or None

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids; text and chat are tokenized on the tokenizer pool, so a
        long prompt or chat template never holds the event loop (which every
        other request's HTTP, gRPC and streaming shares)."""
        try:
            if prompt.token_ids is not None:
                return tokenize(prompt, self.tokenizer)
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_pool, tokenize, prompt, self.tokenizer
            )
        except InvalidRequestError as e:
            raise ServingError("invalid", str(e), e.field) from None

    async def detokenize(self, ids: list[int], field: str = "tokens") -> str:
        """The text of token ids, special tokens kept (as vLLM's /detokenize
        and echo give it), decoded on the tokenizer pool once the ids are
        checked against the vocabulary and the context length."""
        vocab, limit = self.info.vocab_size, self.info.max_model_len
        if self.tokenizer is None:
            raise ServingError("invalid", "this model has no tokenizer on the router", field)
        if len(ids) > limit:
            raise ServingError("invalid", f"{field} has {len(ids)} token ids; max_model_len is {limit}", field)
        for t in ids:
            if not 0 <= t < vocab:
                raise ServingError("invalid", f"token id {t} is outside the vocabulary [0, {vocab})", field)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, partial(self.tokenizer.decode, ids, skip_special_tokens=False)
        )

    def start_span(
        self,
        parent,
        operation: str,
        request_id: str,
        client_request_id: str | None,
        stream: bool,
        lora_name: str | None = None,
    ) -> object | None:
        """The request's trace span (observability/tracing.py), a child of the
        client's context `parent`; None when tracing is off. Under a LoRA
        adapter the span's model is the adapter, and shoal.lora its id."""
        span = tracing.start_request_span(
            parent,
            operation,
            self.info.model if lora_name is None else lora_name,
            request_id=request_id,
            client_request_id=client_request_id,
            stream=stream,
        )
        if span is not None and lora_name is not None:
            span.set_attribute("shoal.lora", self.loras.get(lora_name, 0))
        return span

    async def prepare(self, prompt: Prompt, sampling: dict, span=None) -> tuple[list[int], SamplingParams]:
        """Token ids and SamplingParams, or a ServingError('invalid') naming
        the field (which also ends `span`, the request's, as failed)."""
        if span is None:
            ids, params = self._check(await self.tokenize(prompt), sampling)
            await self.check_grammar(params)
            return ids, params
        try:
            with tracing.stage_span(span, "shoal.prepare"):
                ids, params = self._check(await self.tokenize(prompt), sampling)
                await self.check_grammar(params)
        except ServingError as e:
            tracing.fail_request_span(span, e)
            raise
        span.set_attribute("gen_ai.usage.input_tokens", len(ids))
        tracing.set_request_params(span, **tracing.request_params(params))
        return ids, params

    async def check_grammar(self, params: SamplingParams) -> None:
        """A structured output the grammar library refuses is a 400 naming its
        field before any worker sees it (checked on the tokenizer pool, bounded
        by --grammar-compile-timeout-s; the worker compiles it again)."""
        spec = params.structured_outputs
        if spec is None:
            return
        timeout = self.info.grammar_compile_timeout_s
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, validate_grammar, spec), timeout
            )
        except TimeoutError:
            raise ServingError(
                "invalid",
                f"{spec.field}: the grammar took longer than {timeout:g} s to compile (--grammar-compile-timeout-s)",
                spec.field,
            ) from None
        except InvalidRequestError as e:
            raise ServingError("invalid", str(e), e.field) from None

    def _check(self, ids: list[int], sampling: dict) -> tuple[list[int], SamplingParams]:
        """The engine's own check (request_checks), so a bad request is
        refused here with the same words the worker would use."""
        n, limit = len(ids), self.info.max_model_len
        try:
            if n == 0:
                raise InvalidRequestError("prompt is empty", field="prompt")
            if n >= limit:
                raise InvalidRequestError(f"prompt has {n} tokens; max_model_len is {limit}", field="prompt")
            sampling = dict(sampling)
            if sampling.get("max_tokens") is None:  # OpenAI chat: up to the context length
                sampling["max_tokens"] = limit - n
            params = SamplingParams(**sampling)
            check_request(ids, params, self.limits)
        except InvalidRequestError as e:
            raise ServingError("invalid", str(e), e.field) from None
        except TypeError as e:  # an unknown or missing field: the front's bug, but never a 500
            raise ServingError("invalid", str(e)) from None
        return ids, params

    # ---- requests -----------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        """The engine's id for a request, and the id its response carries
        (vLLM's form: `cmpl-<random hex>`)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        client_request_id: str | None = None,
        priority: int = 0,
        span=None,
        parent_request_id: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[GenerateDelta]:
        """Stream one request. Raises ServingError before the first delta when
        the request is refused (draining, full, invalid). `span` (start_span's)
        ends with the request. parent_request_id: its parallel-sampling group
        (GenerateRequest's); lora_name: its adapter (check_model's)."""
        if self.draining:
            err = ServingError("unavailable", "the server is shutting down")
            tracing.fail_request_span(span, err)
            raise err
        arrival = time.time()
        # The prompt's prefix-cache chain, hashed once here: the request router ranks replicas by it.
        request = GenerateRequest(
            request_id,
            prompt_ids,
            params,
            priority,
            client_request_id,
            # Salted by the adapter as the workers salt it: a prefix cached under one adapter is not another's.
            chain_hashes(prompt_ids, self.info.block_size, extra=self._lora_salt(lora_name)),
            trace_context=tracing.inject(span) if span is not None else None,
            parent_request_id=parent_request_id,
            lora_name=lora_name,
        )
        self.num_in_flight += 1
        self._idle.clear()
        first_token = last_token = None
        gaps: list[float] = []  # inter-token latencies, for the metrics
        try:
            async with aclosing(self.pool.generate(request)) as stream:
                async for msg in stream:
                    if isinstance(msg, WorkerError):
                        if msg.kind == "failed":  # the request alone failed in the engine
                            raise ServingError("internal", msg.message, code=msg.code or "request_failed")
                        raise ServingError(msg.kind, msg.message, msg.field, msg.code)
                    if n := len(msg.token_ids):
                        now = time.time()
                        if first_token is None:
                            first_token = last_token = now
                            self.metrics.first_token(now - arrival)
                            n -= 1
                        if n:  # a merged delta's tokens share its gap
                            gaps.extend([(now - last_token) / n] * n)
                        last_token = now
                    if (f := msg.finished) is not None:
                        now = time.time()
                        f.time_to_first_token_s = (first_token or now) - arrival
                        f.total_s = now - arrival
                        self.metrics.finished(f, gaps)
                        tracing.finish_request_span(span, f, response_model=lora_name or self.info.model)
                    yield msg
        except ServingError as e:
            tracing.fail_request_span(span, e)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # the worker died or its stream broke: say so, never hang
            logger.warning("%s failed in its worker: %r", request.log_name, e)
            err = ServingError(
                "unavailable",
                f"the worker serving this request failed ({type(e).__name__}); retry",
                code="worker_failed",
            )
            tracing.fail_request_span(span, err)
            raise err from None
        finally:
            tracing.end_request_span(span, cancelled=True)  # the client went away (a no-op once ended)
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    async def load(self) -> list[WorkerLoad]:
        out = []
        for s in await self.pool.stats():
            if isinstance(s, BaseException):
                logger.warning("a worker did not report its load: %r", s)
                continue
            out.append(s)
        return sorted(out, key=lambda s: s.worker)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to timeout_s for those in flight;
        return how many were still running at the deadline."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.num_in_flight


def _from_worker(error, field: str) -> ServingError:
    """A worker's answer to a LoRA load or unload (a WorkerError, or what the call raised)."""
    if isinstance(error, WorkerError):
        kind = error.kind if error.kind in ("invalid", "not_found", "conflict") else "internal"
        return ServingError(kind, error.message, error.field or field)
    return ServingError("unavailable", f"a worker did not answer: {type(error).__name__}", code="worker_failed")
