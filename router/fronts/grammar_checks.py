"""The router's check of a request's structured output (its JSON schema's
text and $refs, then the grammar library's own check), before any worker
sees it: on a small pool of its own, never the event loop nor the
tokenizer's threads; once per request (its prompts and samples share the
spec object, which remembers it passed) and once per distinct spec in the
process (the verdict caches: structured_params.SPEC_CHECKS,
grammar.GRAMMAR_CHECKS). The work is bounded by the spec's size cap and
the library's fuel (grammar.LIMITS); a check still queued at the timeout
is cancelled, and past max_pending waiting checks a request is told to
retry (429)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from shoal.proto.errors import InvalidRequestError
from shoal.proto.grammar import validate as validate_grammar
from shoal.proto.structured_params import StructuredOutputsParams
from shoal.router.fronts.serving_error import ServingError


class GrammarChecks:
    def __init__(self, threads: int = 2, max_pending: int = 64):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shoal-spec-check")
        self.max_pending = max_pending
        self.num_pending = 0

    async def check(self, spec: StructuredOutputsParams | None, timeout_s: float) -> None:
        """Raise ServingError: 'invalid' naming spec.field when it is refused or
        its check outlasts timeout_s (--grammar-compile-timeout-s), 'full' when
        too many checks wait already."""
        if not isinstance(spec, StructuredOutputsParams):
            return  # none (a bad value is SamplingParams' to refuse)
        try:
            spec.check_shape()
        except InvalidRequestError as e:
            raise ServingError("invalid", str(e), e.field) from None
        if spec.passed("grammar"):
            return  # this request's other prompts and samples
        if self.num_pending >= self.max_pending:
            raise ServingError("full", f"{self.max_pending} structured-output specs are being checked; retry")
        self.num_pending += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(self._pool, validate_grammar, spec)
            await asyncio.wait_for(work, timeout_s)  # cancels the check if it has not started
        except TimeoutError:
            raise ServingError(
                "invalid",
                f"{spec.field}: the grammar took longer than {timeout_s:g} s to compile (--grammar-compile-timeout-s)",
                spec.field,
            ) from None
        except InvalidRequestError as e:
            raise ServingError("invalid", str(e), e.field) from None
        finally:
            self.num_pending -= 1
