"""Hermes (Qwen 2.5/3, Hermes, many fine-tunes): content, then any number of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Content is the text before the first block; text between and after blocks is
dropped (vLLM's hermes parser does the same). A last block left unclosed still
counts when its object is complete (a stop string may have eaten the tag)."""

from __future__ import annotations

from shoal.router.fronts.tool_parsers.abstract import ParseState, ToolParser
from shoal.router.fronts.tool_parsers.json_scan import Malformed, scan_call, skip_ws

START, END = "<tool_call>", "</tool_call>"


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParseState:
        first = text.find(START)
        if first < 0:
            return ParseState(text if final else text[: len(text) - held_back(text, START)])
        st = ParseState(text[:first])
        pos = first + len(START)
        try:
            while True:
                close = text.find(END, pos)
                body_end = len(text) if close < 0 else close
                i = skip_ws(text, pos)
                if i == body_end:
                    if close >= 0 or final:
                        raise Malformed("empty block")
                    break
                if text[i] != "{":
                    raise Malformed(text[i])
                call, end = scan_call(text[:body_end], i, ("arguments",))
                st.calls.append(call)
                tail = "" if end is None else text[skip_ws(text, end) : body_end]
                if end is None:
                    if close >= 0 or final:
                        raise Malformed("incomplete call")
                    break
                if tail and (close >= 0 or final or not END.startswith(tail)):
                    raise Malformed(tail)
                if close < 0:
                    break
                pos = text.find(START, close + len(END))
                if pos < 0:
                    break
                pos += len(START)
        except Malformed:
            return ParseState(plain=True)
        return st
