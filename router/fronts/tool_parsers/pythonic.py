"""Pythonic tool calls (Llama 3.2/4, ToolACE): the whole reply is a Python list of
calls with literal keyword arguments, `[get_weather(city="Paris"), f(x=1)]`. Read
with `ast` (never evaluated); each call's arguments become a JSON object. A call's
name goes out when its `(` arrives, its arguments when the call closes.

While streaming, the list is split into its elements by tracking brackets and
quoted strings, each character once; each element is parsed once when it closes.
At the end the whole reply is parsed once more, as a whole reply is."""

from __future__ import annotations

import ast
import json
import re
import string

from shoal.router.fronts.tool_parsers.abstract import (
    ExtractedToolCalls,
    Reader,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from shoal.router.fronts.tool_parsers.json_scan import Malformed, Out, skip_ws

_OPEN, _CLOSE = "([{", ")]}"
_STOP = re.compile(r"""['"()\[\]{},]""")  # what matters outside strings, once a call's `(` came
_QUOTE_STOP = {"'": re.compile(r"['\\]"), '"': re.compile(r'["\\]')}
_NOT_SPACE = re.compile(r"\S")

# where the reader is
_LEAD, _LIST, _AFTER_LIST = range(3)
# where an element's head (`name(`) is: spaces, the name, spaces after it, past its `(`
_H_SPACE, _H_NAME, _H_SPACE2, _H_DONE = range(4)


def _call(node: ast.expr) -> tuple[str, str]:
    """(name, JSON arguments) of a call with literal keyword arguments."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise Malformed("not a call with keyword arguments")
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            raise Malformed("**kwargs")
        # allow_nan=False: `1e999` is not JSON
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as e:  # not a literal, or not JSON
        raise Malformed(str(e)[:80]) from None


def _parse(src: str) -> ast.expr:
    try:
        return ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise Malformed(str(e)[:80]) from None


def whole_calls(text: str) -> list[tuple[str, str]]:
    node = _parse(text)
    if not isinstance(node, ast.List) or not node.elts:
        raise Malformed("not a list of calls")
    return [_call(e) for e in node.elts]


def _word(c: str) -> bool:  # re's \w
    return c == "_" or c.isalnum()


class PythonicReader(Reader):
    def __init__(self, out: Out):
        super().__init__(out)
        self.state = _LEAD
        self._depth = 0
        self._quote = ""  # the open string's quote
        self._esc = False  # a backslash ended the last delta inside a string
        self._elem: list[str] = []  # the open element's text
        self._head = _H_SPACE
        self._name: list[str] = []
        self._named = False  # the open element's name went out
        self.sent: list[tuple[str, str]] = []  # each call's name and the arguments sent

    def feed(self, s: str) -> None:
        i, n = 0, len(s)
        if self.state == _LEAD:
            j = skip_ws(s, 0, n)
            self._scanned += j + 1
            if j == n:
                return
            if s[j] != "[":
                raise Malformed(s[j])
            self.state, i = _LIST, j + 1
        if self.state == _LIST:
            i = self._list(s, i, n)
        if self.state == _AFTER_LIST and i < n:
            self._scanned += n - i
            if _NOT_SPACE.search(s, i, n):
                raise Malformed("text after the list")

    def _list(self, s: str, i: int, n: int) -> int:
        """Reads list text from s[i]; returns where the list closed (past its `]`), or n."""
        seg = i
        while i < n:
            if self._quote:
                if self._esc:
                    self._esc, i = False, i + 1
                    self._scanned += 1
                    continue
                m = _QUOTE_STOP[self._quote].search(s, i, n)
                if m is None:
                    self._scanned += n - i
                    break
                j = m.start()
                self._scanned += j - i + 1
                if s[j] == "\\":
                    self._esc = True
                else:
                    self._quote = ""
                i = j + 1
                continue
            if self._head != _H_DONE:
                c = s[i]
                self._scanned += 1
                if c in ",]":
                    self._element_done(s, seg, i, c)
                    seg = i = i + 1
                    if c == "]":
                        self.state = _AFTER_LIST
                        return i
                    continue
                self._head_char(c)
                i += 1
                continue
            m = _STOP.search(s, i, n)
            if m is None:
                self._scanned += n - i
                break
            j = m.start()
            self._scanned += j - i + 1
            c, i = s[j], j + 1
            if c in "'\"":
                self._quote = c
            elif c in _OPEN:
                self._depth += 1
            elif c in _CLOSE and self._depth:
                self._depth -= 1
            elif self._depth == 0 and c in ",]":
                self._element_done(s, seg, j, c)
                seg = i
                if c == "]":
                    self.state = _AFTER_LIST
                    return i
        self._elem.append(s[seg:n])
        return n

    def _head_char(self, c: str) -> None:
        """The open element before its call's `(`: spaces, a name, spaces (as `\\s*name\\s*\\(`)."""
        h = self._head
        if c.isspace() and h != _H_NAME:
            return
        if h == _H_SPACE and (c == "_" or c in string.ascii_letters):
            self._head = _H_NAME
            self._name.append(c)
        elif h == _H_NAME and _word(c):
            self._name.append(c)
        elif h == _H_NAME and c.isspace():
            self._head = _H_SPACE2
        elif h != _H_SPACE and c == "(":
            self._head, self._depth = _H_DONE, 1
            name = "".join(self._name)
            self.out.call(name)
            self.sent.append((name, ""))
            self._named = True
        else:
            raise Malformed(c)

    def _element_done(self, s: str, seg: int, j: int, c: str) -> None:
        self._elem.append(s[seg:j])
        text = "".join(self._elem)
        self._elem, self._head, self._name, self._depth = [], _H_SPACE, [], 0
        named, self._named = self._named, False
        if c == "]" and not text.strip():  # `[f(x=1),]` and `[]`: Python allows the trailing comma
            return
        node = _parse("[" + text + "]")  # in the list's brackets, as the whole reply parses it (newlines too)
        if not isinstance(node, ast.List) or len(node.elts) != 1:
            raise Malformed("not one call")
        name, args = _call(node.elts[0])
        if not named:
            self.out.call(name)
            self.sent.append((name, ""))
        elif name != self.sent[-1][0]:
            raise Malformed("name")
        self.out.args(args)
        self.sent[-1] = (name, args)

    def finish(self) -> None:
        if self.state == _LEAD:
            raise Malformed("no list")
        # The whole reply as a whole reply is read; what went out must agree with it.
        calls = whole_calls(self.out.text())
        for k, (name, args) in enumerate(calls):
            if k < len(self.sent):
                sent_name, sent_args = self.sent[k]
                if name != sent_name or not args.startswith(sent_args):
                    raise Malformed("the stream disagrees with the whole reply")
                if len(args) > len(sent_args):
                    self.out.args(args[len(sent_args) :])
            else:
                self.out.call(name)
                self.out.args(args)
                self.sent.append((name, args))
        if len(calls) < len(self.sent):
            raise Malformed("the stream disagrees with the whole reply")


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def reader(self, out: Out) -> PythonicReader:
        return PythonicReader(out)

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        i = skip_ws(model_output, 0, len(model_output))
        try:
            if i == len(model_output) or model_output[i] != "[":
                raise Malformed("no list")
            calls = whole_calls(model_output)
        except Malformed:
            return ExtractedToolCalls(False, [], model_output)
        return ExtractedToolCalls(True, [ToolCall(make_tool_call_id(), n, a) for n, a in calls], None)
