"""Llama 3.x JSON tool calls: optionally `<|python_tag|>`, then one call object
`{"name": ..., "parameters": {...}}` (or `"arguments"`), or several separated
by `;`. A reply that does not start so is plain content."""

from __future__ import annotations

from typing import cast

from shoal.router.fronts.tool_parsers.abstract import Reader, ToolParser
from shoal.router.fronts.tool_parsers.json_scan import CallScanner, Malformed, Out, skip_ws

TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")

# where the reader is: before the tag or the first call, in the tag, after it, in a call,
# after a call, after a `;`
_LEAD, _TAG, _AFTER_TAG, _OBJECT, _AFTER_CALL, _SEP = range(6)


class Llama3JsonReader(Reader):
    def __init__(self, out: Out):
        super().__init__(out)
        self.state = _LEAD
        self._matched = 0  # characters of the tag seen

    def feed(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n:
            st = self.state
            if st == _TAG:
                while i < n and self._matched < len(TAG):
                    self._scanned += 1
                    if s[i] != TAG[self._matched]:
                        raise Malformed("not the tag")
                    self._matched += 1
                    i += 1
                if self._matched == len(TAG):
                    self.state = _AFTER_TAG
                continue
            if st == _OBJECT:
                end = cast(CallScanner, self._scanner).feed(s, i, n)
                if end is None:
                    return
                self._retire_scanner()
                self.state, i = _AFTER_CALL, end
                continue
            j = skip_ws(s, i, n)
            self._scanned += j - i + 1
            if j == n:
                return
            c, i = s[j], j + 1
            if c == "{" and st in (_LEAD, _AFTER_TAG, _SEP):
                self._new_scanner(ARGS_KEYS)
                self.state = _OBJECT
            elif c == TAG[0] and st == _LEAD:
                self.state, self._matched = _TAG, 1
            elif c == ";" and st == _AFTER_CALL:
                self.state = _SEP
            else:
                raise Malformed(c)

    def finish(self) -> None:
        if self.state in (_LEAD, _TAG, _AFTER_TAG):
            raise Malformed("no call")
        if self.state == _OBJECT:
            raise Malformed("incomplete call")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def reader(self, out: Out) -> Llama3JsonReader:
        return Llama3JsonReader(out)
