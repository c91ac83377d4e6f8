"""Reading a JSON call object that may still be arriving: where each value starts and ends,
and which text is certainly wrong. Only prefixes are judged here; a complete object is
checked by `json.loads`."""

from __future__ import annotations

import json

from shoal.router.fronts.tool_parsers.abstract import PartialCall

_WS = " \t\r\n"
_SCALAR = set("-+0123456789.eEtruefalsn")
_CLOSE = {"{": "}", "[": "]"}


class Malformed(Exception):
    """The text cannot become a call, whatever follows."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """End (exclusive) of the string opened at s[i], None if it is not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at s[i], None if it may still go on."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        j = i + 1
        while j < len(s):
            c = s[j]
            if c == '"':
                end = string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if c != stack.pop():
                    raise Malformed(s[j])
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] in _SCALAR:
        j += 1
    if j == i:
        raise Malformed(c)
    return None if j == len(s) else j


def scan_call(s: str, i: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call object `{"name": ..., <args key>: {...}}` starting at s[i] (the `{`): the call so
    far and the object's end (None while it is incomplete). Raises Malformed."""
    start, i = i, i + 1
    name: str | None = None
    args: tuple[int, int | None] | None = None
    end = None
    while True:
        i = skip_ws(s, i)
        if i == len(s):
            break
        if s[i] == "}":
            end = i + 1
            break
        if s[i] != '"':
            raise Malformed(s[i])
        key_end = string_end(s, i)
        if key_end is None:
            break
        key = json.loads(s[i:key_end])
        i = skip_ws(s, key_end)
        if i == len(s):
            break
        if s[i] != ":":
            raise Malformed(s[i])
        i = skip_ws(s, i + 1)
        if i == len(s):
            break
        vend = value_end(s, i)
        if key == "name" and vend is not None:
            name = json.loads(s[i:vend])
            if not isinstance(name, str):
                raise Malformed("name")
        elif key in args_keys and args is None:
            if s[i] != "{":
                raise Malformed(key)
            args = (i, vend)
        if vend is None:
            break
        i = skip_ws(s, vend)
        if i == len(s):
            break
        if s[i] == ",":
            i += 1
        elif s[i] == "}":
            end = i + 1
            break
        else:
            raise Malformed(s[i])
    arguments = "" if args is None else s[args[0] : len(s) if args[1] is None else args[1]]
    if end is not None:  # complete: the whole object must be JSON with a name
        try:
            json.loads(s[start:end])
        except ValueError as e:
            raise Malformed(str(e)) from None
        if name is None:
            raise Malformed("no name")
        arguments = arguments or "{}"
    return PartialCall(name, arguments), end
