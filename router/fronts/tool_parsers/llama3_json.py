"""Llama 3.x JSON tool calls: optionally `<|python_tag|>`, then one call object
`{"name": ..., "parameters": {...}}` (or `"arguments"`), or several separated
by `;`. A reply that does not start so is plain content."""

from __future__ import annotations

from shoal.router.fronts.tool_parsers.abstract import ParseState, ToolParser
from shoal.router.fronts.tool_parsers.json_scan import Malformed, scan_call, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParseState:
        i = skip_ws(text, 0)
        if text.startswith(TAG, i):
            i = skip_ws(text, i + len(TAG))
        elif TAG.startswith(text[i:]) and not final:
            return ParseState()  # may still be the tag
        if i == len(text):
            return ParseState(plain=final)
        if text[i] != "{":
            return ParseState(plain=True)
        st = ParseState()
        try:
            while True:
                call, end = scan_call(text, i, ("parameters", "arguments"))
                st.calls.append(call)
                if end is None:
                    if final:
                        raise Malformed("incomplete call")
                    break
                i = skip_ws(text, end)
                if i < len(text) and text[i] == ";":
                    i = skip_ws(text, i + 1)
                if i == len(text):
                    break
                if text[i] != "{" or text[skip_ws(text, end)] != ";":
                    raise Malformed(text[i])
        except Malformed:
            return ParseState(plain=True)
        return st
