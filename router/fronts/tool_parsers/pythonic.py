"""Pythonic tool calls (Llama 3.2/4, ToolACE): the whole reply is a Python list of
calls with literal keyword arguments, `[get_weather(city="Paris"), f(x=1)]`. Read
with `ast` (never evaluated); each call's arguments become a JSON object. A call's
name goes out when its `(` arrives, its arguments when the call closes."""

from __future__ import annotations

import ast
import json
import re

from shoal.router.fronts.tool_parsers.abstract import ParseState, PartialCall, ToolParser
from shoal.router.fronts.tool_parsers.json_scan import Malformed, skip_ws

_NAME = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_OPEN, _CLOSE = "([{", ")]}"


def _call(node: ast.expr) -> PartialCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise Malformed("not a call with keyword arguments")
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            raise Malformed("**kwargs")
        return PartialCall(node.func.id, json.dumps(args, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError) as e:  # not a literal, or not JSON
        raise Malformed(str(e)) from None


def _parse(src: str) -> ast.expr:
    try:
        return ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError) as e:
        raise Malformed(str(e)) from None


def _elements(text: str, i: int) -> tuple[list[str], str, int | None]:
    """The list opened at text[i]: its complete elements, the element still open, and where the
    list closed (None while open). Tracks brackets and quoted strings; validity is left to `ast`."""
    done, depth, quote, j, start = [], 0, "", i + 1, i + 1
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE and depth:
            depth -= 1
        elif depth == 0 and c in ",]":
            done.append(text[start:j])
            start = j + 1
            if c == "]":
                return done, "", j
        j += 1
    return done, text[start:], None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParseState:
        i = skip_ws(text, 0)
        if i == len(text):
            return ParseState(plain=final)
        if text[i] != "[":
            return ParseState(plain=True)
        try:
            if final:
                node = _parse(text)
                if not isinstance(node, ast.List) or not node.elts:
                    raise Malformed("not a list of calls")
                return ParseState(calls=[_call(e) for e in node.elts])
            done, open_, close = _elements(text, i)
            if close is not None and text[close + 1 :].strip():
                raise Malformed("text after the list")
            if close is not None and not done[-1].strip():
                done.pop()  # `[f(x=1),]` and `[]`: Python allows the trailing comma
            calls = [_call(_parse(e)) for e in done]
            m = _NAME.match(open_)
            if m:
                calls.append(PartialCall(m.group(1), ""))
            elif open_.strip() and not re.fullmatch(r"\s*[A-Za-z_]\w*\s*", open_):
                raise Malformed(open_)
        except Malformed:
            return ParseState(plain=True)
        return ParseState(calls=calls)
