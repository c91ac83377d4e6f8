"""Hermes (Qwen 2.5/3, Hermes, many fine-tunes): content, then any number of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Content is the text before the first block; text between and after blocks is
dropped (vLLM's hermes parser does the same). A last block left unclosed still
counts when its object is complete (a stop string may have eaten the tag). A
block ends at the first `</tool_call>`, even one inside a JSON string.

The tags are found in each new delta plus the few characters before it that
could start one, so no text is searched twice."""

from __future__ import annotations

from typing import cast

from shoal.router.fronts.tool_parsers.abstract import Reader, ToolParser
from shoal.router.fronts.tool_parsers.json_scan import CallScanner, Malformed, Out, skip_ws

START, END = "<tool_call>", "</tool_call>"

# where the reader is
_CONTENT, _BLOCK, _OBJECT, _AFTER_OBJECT, _BETWEEN = range(5)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesReader(Reader):
    def __init__(self, out: Out):
        super().__init__(out)
        self.state = _CONTENT
        self._held = ""  # the end of the text outside blocks that could start a `<tool_call>`
        self._tail = ""  # the end of the block's body that could start a `</tool_call>`
        self._matched = 0  # characters of `</tool_call>` seen after the call object

    def feed(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n:
            st = self.state
            if st == _CONTENT or st == _BETWEEN:
                text = self._held + s[i:]
                self._scanned += len(text)
                p = text.find(START)
                if p < 0:
                    keep = held_back(text, START)
                    if st == _CONTENT and len(text) > keep:
                        self.out.content(text[: len(text) - keep])
                    self._held = text[len(text) - keep :]
                    return
                if st == _CONTENT and p:
                    self.out.content(text[:p])
                i += p + len(START) - len(self._held)
                self._held = ""
                self.state = _BLOCK
            elif st == _BLOCK:
                j = skip_ws(s, i, n)
                self._scanned += j - i + 1
                if j == n:
                    return
                if s[j] != "{":  # not a call object (`</tool_call>` at once: an empty block)
                    raise Malformed(s[j])
                self._new_scanner(("arguments",))
                self._tail = ""
                self.state, i = _OBJECT, j + 1
            elif st == _OBJECT:
                # the block ends at the first `</tool_call>`: the object may not reach past it
                body = self._tail + s[i:]
                self._scanned += len(body)
                p = body.find(END)
                stop = n if p < 0 else max(i, i + p - len(self._tail))
                end = cast(CallScanner, self._scanner).feed(s, i, stop)
                if end is None:
                    if p >= 0:
                        raise Malformed("incomplete call")
                    self._tail = body[-(len(END) - 1) :]
                    return
                self._retire_scanner()
                self.state, self._matched, i = _AFTER_OBJECT, 0, end
            else:  # _AFTER_OBJECT: whitespace, then `</tool_call>`
                if self._matched == 0:
                    j = skip_ws(s, i, n)
                    self._scanned += j - i
                    i = j
                while i < n and self._matched < len(END):
                    self._scanned += 1
                    if s[i] != END[self._matched]:
                        raise Malformed(s[i])
                    self._matched += 1
                    i += 1
                if self._matched == len(END):
                    self.state, self._held = _BETWEEN, ""

    def finish(self) -> None:
        st = self.state
        if st == _CONTENT and self._held:
            self.out.content(self._held)
            self._held = ""
        elif st == _BLOCK:
            raise Malformed("empty block")
        elif st == _OBJECT:
            raise Malformed("incomplete call")
        elif st == _AFTER_OBJECT and self._matched:
            raise Malformed("cut end tag")


class HermesToolParser(ToolParser):
    name = "hermes"

    def reader(self, out: Out) -> HermesReader:
        return HermesReader(out)
