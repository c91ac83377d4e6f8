"""Compiles each distinct spec once (an LRU cache, bounded), on its own
threads so a slow compile never holds the engine's step, and builds each
step's token bitmask for the constrained rows."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shoal.workers.core.structured_outputs import StructuredOutputsParams
from shoal.workers.errors import InvalidRequestError
from shoal.workers.structured_output.backend import StructuredOutputBackend
from shoal.workers.structured_output.request import StructuredOutputRequest


@dataclass(slots=True)
class GrammarBitmask:
    """rows: id(sequence) -> its row of bitmask (int32 words: bit j of word
    i allows token 32i+j). Keyed by the sequence, since the runner orders
    the step's rows its own way."""

    rows: dict[int, int]
    bitmask: np.ndarray


class StructuredOutputManager:
    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
    ):
        self._make_backend, self._backend = make_backend, None
        self.cache_size, self.compile_timeout_s = cache_size, compile_timeout_s
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="shoal-grammar")
        self.num_compiled = self.num_cache_hits = 0
        self.compile_seconds: list[float] = []  # each compile's wall time (bench structured reads them)

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
        return self._future(params).result()

    async def compile_async(self, params: StructuredOutputsParams):
        """The compiled grammar, compiled on the manager's threads; a compile
        past compile_timeout_s is refused (InvalidRequestError), and its
        result still lands in the cache when it ends."""
        future = asyncio.wrap_future(self._future(params))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.compile_timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"{params.field}: compiling the grammar took longer than {self.compile_timeout_s:g} s "
                "(--grammar-compile-timeout-s)",
                field=params.field,
            ) from None

    def _future(self, params: StructuredOutputsParams) -> Future:
        key = (params.kind, params.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            future = self._compiling.get(key)
            if future is None:  # one compile per spec, however many requests wait on it
                future = self._compiling[key] = self._pool.submit(self._compile, key, params)
            return future

    def _compile(self, key: tuple[str, str], params: StructuredOutputsParams):
        t0 = time.perf_counter()
        try:
            backend = self.backend
            t0 = time.perf_counter()  # the compile alone, not the backend's one-time start
            compiled = backend.compile(params)
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - t0)
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
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
