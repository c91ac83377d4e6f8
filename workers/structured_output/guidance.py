"""The llguidance backend: the tokenizer's own JSON builds its token trie
(GGUF tokenizers included, since shoal holds every one as a `tokenizers`
object), and a compiled grammar is an LLMatcher at its start that each
request copies."""

from __future__ import annotations

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from shoal.proto.errors import InvalidRequestError
from shoal.proto.grammar import LIMITS, _short, grammar_text, what
from shoal.proto.structured_params import StructuredOutputsParams


class GuidanceGrammar:
    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(tokens) and not self.matcher.is_error()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llg_np.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], num_threads: int | None = None):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(num_threads)

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidRequestError(
                f"{params.field}: {what(params)} is not supported: {_short(matcher.get_error())}", field=params.field
            )
        return matcher

    def new_grammar(self, compiled: llguidance.LLMatcher) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.deep_copy())

    def fill_bitmasks(self, grammars: list[tuple[GuidanceGrammar, int]], bitmask: np.ndarray) -> None:
        llg_np.fill_next_token_bitmask_par(self.executor, [(g.matcher, row) for g, row in grammars], bitmask)
