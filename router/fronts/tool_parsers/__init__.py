"""Tool-call parsers for `tool_choice: "auto"`: each reads one model family's way of
writing calls, from a whole reply (`extract_tool_calls`) or a streamed one
(`stream()` fed text deltas), chosen by `--tool-call-parser`."""

from __future__ import annotations

from shoal.router.fronts.tool_parsers.abstract import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)
from shoal.router.fronts.tool_parsers.hermes import HermesToolParser
from shoal.router.fronts.tool_parsers.llama3_json import Llama3JsonToolParser
from shoal.router.fronts.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "make_tool_call_id",
]
