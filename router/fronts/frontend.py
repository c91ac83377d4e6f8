"""The router's core, shared by the HTTP and gRPC fronts: check the key,
validate and tokenize, send to a worker, stream its deltas back, drain."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from shoal.proto.block_hash import chain_hashes
from shoal.proto.errors import InvalidRequestError
from shoal.proto.lora.registry import LoRARegistry
from shoal.proto.messages import GenerateDelta, GenerateRequest, WorkerError, WorkerInfo, WorkerLoad
from shoal.proto.request_checks import RequestLimits, check_request
from shoal.proto.sampling_params import SamplingParams
from shoal.router.fronts.admission import Admission, Admitted
from shoal.router.fronts.cache_isolation import CacheIsolation
from shoal.router.fronts.grammar_checks import GrammarChecks
from shoal.router.fronts.load_snapshot import LoadSnapshot
from shoal.router.fronts.lora_adapters import LoRAAdapters
from shoal.router.fronts.prompt import Prompt, tokenize
from shoal.router.fronts.serving_error import ServingError
from shoal.router.observability import tracing
from shoal.router.observability.metrics import RouterMetrics
from shoal.router.routing.pool import WorkerPool
from shoal.router.routing.stream_buffer import StreamBufferFull

logger = logging.getLogger(__name__)
# Bounded: a client's own request id goes into the log lines of its request.
MAX_CLIENT_REQUEST_ID_LEN = 256


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
    max_logit_bias: int = 300

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
            info.max_logit_bias,
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
        cache_isolation: str | None = None,
        max_concurrent_requests: int | None = None,
        max_tokens_per_request: int | None = None,
        lora_root: str | None = None,
        max_runtime_loras: int | None = None,
        metrics_include_lora_names: bool = False,
    ):
        self.pool, self.tokenizer, self.info = pool, tokenizer, info
        # Sequences in flight (--max-concurrent-requests; None: no cap) and one request's tokens
        # (--max-tokens-per-request; None: the model's context): admission.py.
        self.admission = Admission(max_concurrent_requests, max_tokens_per_request or info.max_model_len)
        # Runtime loads: inside --lora-root (None: anywhere), at most --max-runtime-loras (None: no cap).
        self.lora = LoRAAdapters(
            pool,
            info.model,
            info.enable_lora,
            info.loras,
            self.load,
            allow_runtime_lora_updating,
            lora_registry,
            lora_root,
            max_runtime_loras,
        )
        self.api_key = api_key or None
        # --cache-isolation (unset: `key` when an API key is set): whose prefixes a request may share.
        self.cache_isolation = CacheIsolation.build(cache_isolation, self.api_key)
        self.max_prompts = max_prompts  # prompts in one completions request
        self.limits = RequestLimits(
            info.vocab_size,
            info.max_model_len,
            info.max_logprobs,
            info.max_stop_strings,
            info.max_n,
            info.max_logit_bias,
        )
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="shoal-tokenize")
        self.grammar_checks = GrammarChecks()  # structured-output specs: a pool of their own
        self.metrics = RouterMetrics(info.model, info.max_model_len, info.max_loras, metrics_include_lora_names)
        self.load_snapshot = LoadSnapshot(self.load)  # what the open /health and /metrics read
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

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer pool (bounded: --tokenizer-threads), for
        work that grows with a request (a large body's JSON), so that it
        never holds the event loop every other request shares."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

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
            span.set_attribute("shoal.lora", self.lora.ids.get(lora_name, 0))
        return span

    async def prepare(self, prompt: Prompt, sampling: dict, span=None) -> tuple[list[int], SamplingParams]:
        """Token ids and SamplingParams, or a ServingError('invalid') naming
        the field (which also ends `span`, the request's, as failed)."""
        if span is None:
            await self.check_grammar(sampling.get("structured_outputs"))
            return self._check(await self.tokenize(prompt), sampling)
        try:
            with tracing.stage_span(span, "shoal.prepare"):
                await self.check_grammar(sampling.get("structured_outputs"))
                ids, params = self._check(await self.tokenize(prompt), sampling)
        except ServingError as e:
            tracing.fail_request_span(span, e)
            raise
        span.set_attribute("gen_ai.usage.input_tokens", len(ids))
        tracing.set_request_params(span, **tracing.request_params(params))
        return ids, params

    async def check_grammar(self, spec) -> None:
        """A structured output (the request's StructuredOutputsParams) that its
        own check or the grammar library refuses is a 400 naming its field
        before any worker sees it: checked off the event loop on a pool of its
        own, once per request and once per distinct spec, bounded by
        --grammar-compile-timeout-s (grammar_checks.py; the worker compiles
        it again). Before _check, whose SamplingParams then find it checked."""
        await self.grammar_checks.check(spec, self.info.grammar_compile_timeout_s)

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
        cache_salt: str | None = None,
        caller: bytes | None = None,
        admitted: Admitted | None = None,
    ) -> AsyncGenerator[GenerateDelta, None]:
        """Stream one request. Raises ServingError before the first delta when
        the request is refused (draining, full, invalid). `span` (start_span's)
        ends with the request. parent_request_id: its parallel-sampling group
        (GenerateRequest's); lora_name: its adapter (LoRAAdapters.resolve_model's);
        cache_salt: the client's (checked by its front), which --cache-isolation
        key folds with the caller's identity (`caller`, CacheIsolation.identity;
        None: the one API key's); admitted: the request's sequences (admission.py),
        one of which this stream holds until it ends."""
        if self.draining:
            err = ServingError("unavailable", "the server is shutting down")
            tracing.fail_request_span(span, err)
            raise err
        arrival = time.time()
        salt = self.cache_isolation.salt(cache_salt, caller)
        # The prompt's prefix-cache chain, hashed once here: the request router ranks replicas by it.
        request = GenerateRequest(
            request_id,
            prompt_ids,
            params,
            priority,
            client_request_id,
            # Salted by the adapter as the workers salt it: a prefix cached under one adapter is not another's.
            # And by the request's salt, as the workers salt it: only prompts of one salt share blocks.
            chain_hashes(prompt_ids, self.info.block_size, extra=self.lora.salt(lora_name), cache_salt=salt),
            trace_context=tracing.inject(span) if span is not None else None,
            parent_request_id=parent_request_id,
            lora_name=lora_name,
            cache_salt=salt,
        )
        claimed = admitted is not None and admitted.claim()
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
                            gaps.extend([(now - cast(float, last_token)) / n] * n)
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
        except StreamBufferFull as e:  # its client stopped reading; the worker was told to abort it
            err = ServingError("full", str(e), code="stream_buffer_full")
            tracing.fail_request_span(span, err)
            raise err from None
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
            if claimed:  # admitted is set
                cast(Admitted, admitted).release()
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
