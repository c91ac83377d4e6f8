"""A sequence's structured output: its spec and its matcher, which advances
with every token the sequence takes (Scheduler.update_from_output)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.proto.structured_params import StructuredOutputsParams
from shoal.workers.structured_output.backend import StructuredOutputGrammar


@dataclass(slots=True)
class StructuredOutputRequest:
    params: StructuredOutputsParams
    grammar: StructuredOutputGrammar
