"""The seam between the engine and a grammar library (vLLM's
StructuredOutputBackend / StructuredOutputGrammar): the manager, the
scheduler and the sampler see only these two shapes."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from shoal.proto.structured_params import StructuredOutputsParams


class StructuredOutputGrammar(Protocol):
    """One request's matcher: where its output stands in the grammar."""

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance by sampled tokens; False (and no use after) if one is not allowed."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit j of word i: token 32i+j)."""

    def is_terminated(self) -> bool:
        """Nothing but the end can follow: the output is complete."""

    def is_accepting(self) -> bool:
        """The output so far is a whole match (it may still go on)."""


class StructuredOutputBackend(Protocol):
    name: str
    vocab_size: int  # the model's: one mask bit per logit

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar (cached, shared): raises InvalidRequestError
        naming params.field when the library refuses the spec."""

    def new_grammar(self, compiled: object) -> StructuredOutputGrammar:
        """A fresh matcher at the start of a compiled grammar."""

    def fill_bitmasks(self, grammars: list[tuple[StructuredOutputGrammar, int]], bitmask: np.ndarray) -> None:
        """Every (grammar, row)'s mask at once (the library may spread them over threads)."""
