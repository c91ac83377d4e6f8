"""The HTTP API's JSON reader: RFC 8259 and nothing looser. Python's json
takes NaN and Infinity, turns 1e400 into inf, keeps lone surrogates and
recurses once per nesting level; each is a 400 here, naming the field.

Each check runs over the text or the parsed object in C (regular
expressions, json's own encoder); only a body already known to be bad is
walked in Python, to name the field, and that walk has a budget. A walk of
every node cost a 4 MB body of a million empty objects 1.5 s of Python,
which starved the event loop of the GIL though it ran on another thread."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np

from shoal.router.fronts.frontend import ServingError

MAX_DEPTH = 64
# Arrays and objects in one body. Each is a GC-tracked object that json
# builds in one C call holding the GIL (a million empty ones: 0.1-0.3 s,
# then as long again in collections); a chat of thousands of messages with
# tools needs tens of thousands. Token ids and strings are not containers.
MAX_CONTAINERS = 65_536
WALK_BUDGET = 100_000  # nodes a walk for a bad field's name visits before it settles for the problem alone
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: a pair is fine, a lone one is not
_LONG_DIGITS = re.compile(r"\d{309}")  # float() overflows from 309 digits on
_NUMBER = re.compile(rb"[-+.\deE]{309,}")  # outside strings: a number's whole token
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


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


def _walk(obj, check_strings: bool) -> None:
    """Raise the first problem found in obj, naming its field: depth, bad
    numbers, lone surrogates, iteratively (no recursion to blow up), over
    at most WALK_BUDGET nodes. Only a body known to be bad is walked."""
    stack = [(obj, "", 1)]
    budget = WALK_BUDGET
    while stack and budget > 0:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ServingError(
                "invalid",
                f"the JSON body nests deeper than {MAX_DEPTH} levels",
                field=path.split(".")[0].split("[")[0] or None,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in itertools.islice(items, budget):
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
        budget -= len(node)


def _outside_strings(text: str) -> np.ndarray:
    """The UTF-8 bytes of JSON text with every string's bytes (quotes
    included) blanked, in vectorised passes: a quote opens or closes a
    string unless an odd run of backslashes escapes it."""
    b = np.frombuffer(text.encode("utf-8"), np.uint8)
    backslash = b == ord("\\")
    count = np.cumsum(backslash, dtype=np.int32)
    run = count - np.maximum.accumulate(np.where(backslash, 0, count))  # backslashes in a row ending here
    escaped = np.zeros(len(b), bool)
    escaped[1:] = (run[:-1] & 1).astype(bool)
    quote = (b == ord('"')) & ~escaped
    inside = (np.cumsum(quote, dtype=np.int32) & 1).astype(bool) | quote
    return np.where(inside, np.uint8(ord(" ")), b)


def _max_depth(outside: np.ndarray) -> int:
    """How deep JSON text nests, from its bytes outside strings."""
    return int(np.cumsum(_DEPTH_STEP[outside], dtype=np.int32).max(initial=0))


def _has_huge_int(outside: np.ndarray) -> bool:
    """An integer float() cannot hold, among the bytes outside strings (a
    float's overflow is the parse_float hook's to catch)."""
    for m in _NUMBER.finditer(outside.tobytes()):
        token = m.group().lstrip(b"-")
        if token.isdigit() and _huge(int(token)):
            return True
    return False


def _no_value(bad: _Bad) -> None:
    return None  # a bad number: the walk names it, here it is no string


def _lone_surrogate(obj) -> bool:
    """Whether a string anywhere in obj (keys too) holds a lone surrogate:
    json's C encoder meets every string, and UTF-8 has no surrogates."""
    try:
        json.dumps(obj, ensure_ascii=False, default=_no_value).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


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
    outside, deep = None, False
    if text.count("[") + text.count("{") > MAX_DEPTH or _LONG_DIGITS.search(text):  # else neither deep nor huge
        outside = _outside_strings(text)
        deep = _max_depth(outside) > MAX_DEPTH
        containers = int(np.count_nonzero(_DEPTH_STEP[outside] == 1))
        if deep and containers > MAX_CONTAINERS:
            raise ServingError("invalid", f"the JSON body nests deeper than {MAX_DEPTH} levels")
        if containers > MAX_CONTAINERS:
            raise ServingError("invalid", f"the JSON body holds {containers} arrays and objects, over {MAX_CONTAINERS}")
    hooks = _Hooks()
    try:
        obj = json.loads(text, parse_constant=hooks.constant, parse_float=hooks.float)
    except RecursionError:
        raise ServingError("invalid", f"the JSON body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise ServingError("invalid", f"malformed JSON body: {e}") from None
    if isinstance(obj, _Bad):
        raise ServingError("invalid", f"{obj.text} is not a finite number")
    if _huge(obj):
        raise ServingError("invalid", f"{str(obj)[:20]}... is not a finite number")
    if isinstance(obj, str):
        _check_string(obj, "body")
    if not isinstance(obj, (dict, list)):
        return obj
    # The checks in C first; a walk in Python only to name a known problem's field.
    lone = _SURROGATE_ESCAPE.search(text) is not None and _lone_surrogate(obj)
    huge = outside is not None and _LONG_DIGITS.search(text) is not None and _has_huge_int(outside)
    if not (hooks.bad or lone or deep or huge):
        return obj
    _walk(obj, lone)
    if deep:  # the walk ran out of budget before it met the problem
        raise ServingError("invalid", f"the JSON body nests deeper than {MAX_DEPTH} levels")
    if lone:
        raise ServingError("invalid", "a string in the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    raise ServingError("invalid", "a number in the body is not finite")
