"""The HTTP API's JSON reader: RFC 8259 and nothing looser. Python's json
takes NaN and Infinity, turns 1e400 into inf, keeps lone surrogates and
recurses once per nesting level; each is a 400 here, naming the field."""

from __future__ import annotations

import json
import math
import re

from shoal.router.fronts.frontend import ServingError

MAX_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: a pair is fine, a lone one is not


class _Bad:
    """A number JSON should not carry, kept in place so the walk can name its field."""

    def __init__(self, text: str):
        self.text = text


class _Hooks:
    def __init__(self):
        self.bad = False

    def constant(self, text: str) -> _Bad:  # NaN, Infinity, -Infinity
        self.bad = True
        return _Bad(text)

    def float(self, text: str) -> float | _Bad:
        value = float(text)
        if math.isfinite(value):
            return value
        self.bad = True
        return _Bad(text)


# An int float() cannot hold (past 4300 digits json itself refuses it as malformed).
def _huge(value) -> bool:
    return type(value) is int and value.bit_length() > 1023 and not math.isfinite(_as_float(value))


def _as_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _path(parent: str, key) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _walk(obj, check_strings: bool, whole: bool) -> None:
    """Depth, bad numbers and lone surrogates, iteratively (no recursion to blow
    up). Unless `whole`, lists of ints (token ids) are skipped: an id is never
    made a float, and the vocabulary check refuses a huge one."""
    stack = [(obj, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if not whole and isinstance(node, list) and node and type(node[0]) is int:
            continue
        if depth > MAX_DEPTH:
            raise ServingError(
                "invalid",
                f"the JSON body nests deeper than {MAX_DEPTH} levels",
                field=path.split(".")[0].split("[")[0] or None,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = _path(path, key)
            if check_strings and isinstance(key, str):
                _check_string(key, path or "body")
            if isinstance(value, (dict, list)):
                stack.append((value, where, depth + 1))
            elif isinstance(value, _Bad):
                raise ServingError("invalid", f"{where}: {value.text} is not a finite number", field=where)
            elif _huge(value):
                raise ServingError("invalid", f"{where}: {str(value)[:20]}... is not a finite number", field=where)
            elif check_strings and isinstance(value, str):
                _check_string(value, where)


def _check_string(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ServingError(
            "invalid", f"{where}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)", field=where
        ) from None


def loads(body: bytes):
    """The parsed body, or ServingError('invalid') naming the field or the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ServingError("invalid", f"the body is not valid UTF-8 (byte {e.start})") from None
    hooks = _Hooks()
    try:
        obj = json.loads(text, parse_constant=hooks.constant, parse_float=hooks.float)
    except RecursionError:
        raise ServingError("invalid", f"the JSON body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise ServingError("invalid", f"malformed JSON body: {e}") from None
    if isinstance(obj, _Bad) or _huge(obj):
        raise ServingError("invalid", f"{obj.text} is not a finite number")
    if isinstance(obj, str):
        _check_string(obj, "body")
    check_strings = _SURROGATE_ESCAPE.search(text) is not None
    # A body with few brackets cannot nest deep: only a suspect one is walked.
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    if isinstance(obj, (dict, list)):
        # The whole body only when it is suspect; else its fields, not its token ids.
        _walk(obj, check_strings, whole=hooks.bad or check_strings or deep)
    return obj
