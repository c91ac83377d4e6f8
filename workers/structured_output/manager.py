"""Compiles each distinct spec once (an LRU cache, bounded), on its own
threads so a slow compile never holds the engine's step, and builds each
step's token bitmask for the constrained rows."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shoal.proto.errors import InvalidRequestError
from shoal.proto.structured_params import StructuredOutputsParams
from shoal.workers.structured_output.backend import StructuredOutputBackend
from shoal.workers.structured_output.request import StructuredOutputRequest


@dataclass(slots=True, frozen=True)
class _Refused:
    reason: str  # why the library refused a spec, without the field's name


@dataclass(slots=True)
class GrammarBitmask:
    """rows: id(sequence) -> its row of bitmask (int32 words: bit j of word
    i allows token 32i+j). Keyed by the sequence, since the runner orders
    the step's rows its own way."""

    rows: dict[int, int]
    bitmask: np.ndarray


class StructuredOutputManager:
    """cache_size and cache_chars bound the compiled grammars kept (how many,
    and the length of their specs together, a proxy for their memory);
    each compile runs under the backend's own limits (proto/grammar.py LIMITS), so
    varied specs cost at most that each and never grow the cache past its
    bounds. A spec the library refused is remembered too (its reason, by
    digest): asking again costs nothing."""

    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        cache_chars: int = 16 * 1024 * 1024,
    ):
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self.cache_size, self.cache_chars, self.compile_timeout_s = cache_size, cache_chars, compile_timeout_s
        # digest -> (compiled grammar, its spec's length): keyed by the digest, never the 256 KiB text
        self._cache: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self._cached_chars = 0
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # digest -> why (without the field's name)
        self._compiling: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="shoal-grammar")
        self.num_compiled = self.num_cache_hits = 0
        # The latest compiles' wall times (bench structured reads them); bounded: a worker lives long
        self.compile_seconds: deque[float] = deque(maxlen=1024)

    @property
    def backend(self) -> StructuredOutputBackend:
        """Built on first use (a tokenizer's trie takes a while): by the first
        compile, on the manager's threads."""
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    # ---- compiling --------------------------------------------------------

    def compiled(self, params: StructuredOutputsParams):
        """The compiled grammar of params, from the cache or compiled now (on the caller's thread)."""
        return self._result(params, self._future(params).result())

    async def compile_async(self, params: StructuredOutputsParams):
        """The compiled grammar, compiled on the manager's threads; a compile
        past compile_timeout_s is refused (InvalidRequestError), and its
        result still lands in the cache when it ends."""
        future = asyncio.wrap_future(self._future(params))
        try:
            return self._result(params, await asyncio.wait_for(asyncio.shield(future), self.compile_timeout_s))
        except TimeoutError:
            raise InvalidRequestError(
                f"{params.field}: compiling the grammar took longer than {self.compile_timeout_s:g} s "
                "(--grammar-compile-timeout-s)",
                field=params.field,
            ) from None

    @staticmethod
    def _result(params: StructuredOutputsParams, outcome):
        """The compiled grammar, or the refusal (a reason) raised naming this request's field."""
        if isinstance(outcome, _Refused):
            raise InvalidRequestError(f"{params.field}: {outcome.reason}", field=params.field)
        return outcome

    def _future(self, params: StructuredOutputsParams) -> Future:
        key = params.digest
        with self._lock:
            done: Future = Future()
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                done.set_result(self._cache[key][0])
                return done
            if key in self._refused:
                self._refused.move_to_end(key)
                self.num_cache_hits += 1
                done.set_result(_Refused(self._refused[key]))
                return done
            future = self._compiling.get(key)
            if future is None:  # one compile per spec, however many requests wait on it
                future = self._compiling[key] = self._pool.submit(self._compile, key, params)
            return future

    def _compile(self, key: bytes, params: StructuredOutputsParams):
        t0 = time.perf_counter()
        try:
            backend = self.backend
            t0 = time.perf_counter()  # the compile alone, not the backend's one-time start
            try:
                params.validate()  # the spec's own check (a JSON schema's $refs...), cached per spec
                compiled = backend.compile(params)
            except InvalidRequestError as e:
                text, prefix = str(e), f"{params.field}: "
                refused = _Refused(text[len(prefix) :] if text.startswith(prefix) else text)
                with self._lock:
                    self._refused[key] = refused.reason
                    while len(self._refused) > self.cache_size:
                        self._refused.popitem(last=False)
                return refused
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        size = len(params.spec)
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - t0)
            self.num_compiled += 1
            if size <= self.cache_chars:
                self._cache[key] = (compiled, size)
                self._cached_chars += size
                while len(self._cache) > self.cache_size or self._cached_chars > self.cache_chars:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._cached_chars -= dropped
        return compiled

    def new_request(self, params: StructuredOutputsParams, compiled=None) -> StructuredOutputRequest:
        return StructuredOutputRequest(params, self.backend.new_grammar(compiled or self.compiled(params)))

    # ---- each step --------------------------------------------------------

    def grammar_bitmask(self, seqs: list) -> GrammarBitmask | None:
        """The constrained rows' masks for a step's sequences due a token, or None when none is."""
        constrained = [seq for seq in seqs if seq.structured_output_request is not None]
        if not constrained or self._backend is None:
            return None
        words = (self.backend.vocab_size + 31) // 32
        bitmask = np.full((len(constrained), words), -1, dtype=np.int32)
        self.backend.fill_bitmasks(
            [(s.structured_output_request.grammar, k) for k, s in enumerate(constrained)], bitmask
        )
        return GrammarBitmask({id(s): k for k, s in enumerate(constrained)}, bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
