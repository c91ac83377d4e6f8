"""The xgrammar backend (`--structured-outputs-backend xgrammar`), the
other library vLLM ships, kept to compare against llguidance (`shoal bench
structured`). xgrammar is optional: imported only when this backend is built.

Its masks are meant to equal guidance.py's, state for state: the same compact
JSON (", " and ": ", no free whitespace; properties beyond the schema's
allowed, JSON Schema's default and llguidance's, hence strict_mode off), the
tokenizer's special tokens never text, and a grammar "terminated" when
nothing but a stop token can follow (llguidance's is_stopped), not only
after a stop token is taken, which the engine never feeds to a grammar.
Where they still differ (tests/test_structured_backends.py pins each case):
where the grammar forces the next bytes llguidance allows only their
canonical first token, xgrammar any token inside them; xgrammar takes
"-0" as no integer, a string with maxLength without escapes but with raw
control characters, and in strings DEL, the escape "\\/" and any "\\uXXXX"
(llguidance writes "\\u" only for control characters).
"""

from __future__ import annotations

import json
import os
import re
from typing import cast

import numpy as np

from shoal.proto.errors import InvalidRequestError
from shoal.proto.grammar import what
from shoal.proto.structured_params import StructuredOutputsParams

SEPARATORS = (", ", ": ")
# Fewer rows are filled on the caller's thread: waking the library's pool for
# one row cost 1.9 ms a step at batch 1 (`shoal bench structured`), the fill itself 0.1 ms.
BATCH_FILL_MIN_ROWS = 8


def _short(error) -> str:
    """The library's message, less the time and C++ source line it starts with."""
    text = re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", str(error).strip()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar's TokenizerInfo of a `tokenizers.Tokenizer` (what shoal holds
    for HF folders and GGUF files alike), without transformers. A special
    added token is given as "", which xgrammar takes as a token no text
    matches (llguidance's view of them too)."""
    import xgrammar as xgr

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size:
            encoded[i] = token
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class XgrammarGrammar:
    __slots__ = ("matcher", "stop_words", "_row")

    def __init__(self, matcher, stop_words: np.ndarray):
        self.matcher = matcher
        self.stop_words = stop_words  # a row with only the stop tokens' bits
        self._row: np.ndarray | None = None  # the mask is_terminated made for this state, reused by the next fill

    def accept_tokens(self, tokens: list[int]) -> bool:
        self._row = None
        return all(self.matcher.accept_token(t) for t in tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self._row is not None:
            bitmask[row] = self._row
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """Complete, and only a stop token may follow (a mask fill, made only at a complete state)."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        row = np.full((1, self.stop_words.shape[0]), -1, dtype=np.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        self._row = row[0]
        return not np.any(self._row & ~self.stop_words)

    def is_accepting(self) -> bool:
        return self.matcher.is_terminated() or self.matcher.is_completed()


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], num_threads: int | None = None):
        """tokenizer: the model's `tokenizers.Tokenizer` (Tokenizer.backend);
        num_threads: for compiling and for the masks (default: the cores, as llguidance's)."""
        import xgrammar as xgr

        num_threads = num_threads or os.cpu_count() or 1
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        # No cache of its own: the manager's LRU is the one cache, and it counts the misses.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=num_threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(num_threads)
        words = (vocab_size + 31) // 32
        self.stop_words = np.zeros(words, dtype=np.int32)
        for t in eos_token_ids:
            self.stop_words.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def compile(self, params: StructuredOutputsParams):
        kind, c = params.kind, self.compiler
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(
                    params.spec, any_whitespace=False, separators=SEPARATORS, strict_mode=False
                )
            if kind == "regex":
                return c.compile_regex(cast(str, params.regex))
            if kind == "choice":  # the Lark llguidance makes of a choice
                return c.compile_lark(
                    "start: " + " | ".join(json.dumps(s) for s in cast("tuple[str, ...]", params.choice))
                )
            grammar = cast(str, params.grammar)  # the kind left
            if "::=" in grammar:  # GBNF, rooted at `root`
                return c.compile_grammar(grammar)
            return c.compile_lark(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(
                f"{params.field}: {what(params)} is not supported: {_short(e)}", field=params.field
            ) from None

    def new_grammar(self, compiled) -> XgrammarGrammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled), self.stop_words)

    def fill_bitmasks(self, grammars: list[tuple[XgrammarGrammar, int]], bitmask: np.ndarray) -> None:
        fresh = [(g, row) for g, row in grammars if g._row is None]
        if len(fresh) < BATCH_FILL_MIN_ROWS:
            for g, row in grammars:
                g.fill_bitmask(bitmask, row)
            return
        for g, row in grammars:
            if g._row is not None:
                bitmask[row] = g._row
        self.batch.batch_fill_next_token_bitmask([g.matcher for g, _ in fresh], bitmask, [row for _, row in fresh])
