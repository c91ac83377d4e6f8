"""Reading a JSON call object `{"name": ..., <args key>: {...}}` as it arrives, one delta at a time.

The scanner keeps its place (state, bracket stack, inside a string or not, a pending escape)
between deltas, so each character is looked at once: a delta costs time in proportion to
its length, never to the reply so far. Only the structure is judged on the way (strings,
brackets, scalars); the complete object is checked once by `json.loads`."""

from __future__ import annotations

import json
import re

WS = " \t\r\n"
_SCALAR = set("-+0123456789.eEtruefalsn")
_CLOSE = {"{": "}", "[": "]"}
_NOT_WS = re.compile(r"[^ \t\r\n]")
_STR_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
_NOT_SCALAR = re.compile(r"[^-+0-9.eEtruefalsn]")


class Malformed(Exception):
    """The text cannot become a call, whatever follows."""


def loads(text: str):
    """json.loads with every failure (bad JSON, nesting too deep) a Malformed."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise Malformed(str(e)[:80]) from None


class Out:
    """Where a reader sends what it found, in order: certain content, a call's start (its name
    is complete) and its argument fragments (they concatenate to the call's arguments)."""

    def content(self, text: str) -> None:
        raise NotImplementedError

    def call(self, name: str) -> None:
        raise NotImplementedError

    def args(self, fragment: str) -> None:
        raise NotImplementedError

    def text(self) -> str:
        """The whole reply so far (one join, for a format that must read it whole at its end)."""
        raise NotImplementedError


def skip_ws(s: str, i: int, stop: int) -> int:
    """The first index in s[i:stop] that is not JSON whitespace, or stop."""
    m = _NOT_WS.search(s, i, stop)
    return stop if m is None else m.start()


# scanner states
_KEY_OR_END, _KEY, _COLON, _VALUE_START, _STRING, _CONTAINER, _SCALAR_VALUE, _AFTER_VALUE, _DONE = range(9)


class CallScanner:
    """One call object, its `{` already read. `feed(s, i, stop)` reads s[i:stop] and returns
    where the object ended (just past its `}`), or None while it goes on; raises Malformed.
    The name goes to `out` when it is complete, the arguments object's text as it arrives
    (held until the name is known); a call without arguments gets `{}` at its end."""

    __slots__ = (
        "out",
        "args_keys",
        "state",
        "chars_scanned",
        "_parts",
        "_capture",
        "_role",
        "_key",
        "_stack",
        "_in_str",
        "_esc",
        "name",
        "_args_seen",
        "_held_args",
    )

    def __init__(self, out: Out, args_keys: tuple[str, ...]):
        self.out, self.args_keys = out, args_keys
        self.state = _KEY_OR_END
        self.chars_scanned = 0
        self._parts = ["{"]  # the object's text, checked once by json.loads at its end
        self._capture: list[str] = []  # the key, or the name's value, being read
        self._role = ""  # what the value being read is: "name", "args" or "" (another key)
        self._key = ""
        self._stack: list[str] = []  # closers of the open containers in a value
        self._in_str = False  # inside a string in a container
        self._esc = False  # a backslash ended the last delta inside a string
        self.name: str | None = None
        self._args_seen = False
        self._held_args: list[str] | None = []  # argument text that came before the name

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def feed(self, s: str, i: int, stop: int) -> int | None:
        end = self._scan(s, i, stop)
        self._parts.append(s[i : stop if end is None else end])
        if end is not None:
            self._complete()
        return end

    # ---- internals ----------------------------------------------------------

    def _scan(self, s: str, i: int, stop: int) -> int | None:
        seg = i  # where the text of the key or value being read starts in s
        while i < stop:
            st = self.state
            if st == _STRING or st == _KEY:
                e = self._string(s, i, stop)
                if e is None:
                    self._take(s, seg, stop)
                    return None
                self._take(s, seg, e)
                i = e
                if st == _KEY:
                    self._key = loads("".join(self._capture))
                    if not isinstance(self._key, str):
                        raise Malformed("key")
                    self.state = _COLON
                else:
                    self._value_done()
                continue
            if st == _CONTAINER:
                e = self._container(s, i, stop)
                if e is None:
                    self._take(s, seg, stop)
                    return None
                self._take(s, seg, e)
                i = e
                self._value_done()
                continue
            if st == _SCALAR_VALUE:
                m = _NOT_SCALAR.search(s, i, stop)
                e = stop if m is None else m.start()
                self.chars_scanned += e - i + (m is not None)
                self._take(s, seg, e)
                if m is None:
                    return None
                i = e
                self._value_done()
                continue
            # between tokens: skip whitespace, then one structural character
            m = _NOT_WS.search(s, i, stop)
            if m is None:
                self.chars_scanned += stop - i
                return None
            self.chars_scanned += m.start() - i + 1
            i = m.start()
            c = s[i]
            if st == _KEY_OR_END:
                if c == "}":
                    return self._close(i)
                if c != '"':
                    raise Malformed(c)
                self.state, self._capture = _KEY, ['"']
                i += 1
                seg = i
            elif st == _COLON:
                if c != ":":
                    raise Malformed(c)
                self.state = _VALUE_START
                i += 1
            elif st == _VALUE_START:
                seg = i
                self._start_value(c)
                if c in _CLOSE:
                    self._stack = [_CLOSE[c]]
                    self.state = _CONTAINER
                    i += 1
                elif c == '"':
                    self.state = _STRING
                    i += 1
                elif c in _SCALAR:
                    self.state = _SCALAR_VALUE
                else:
                    raise Malformed(c)
            elif st == _AFTER_VALUE:
                if c == ",":
                    self.state = _KEY_OR_END
                    i += 1
                elif c == "}":
                    return self._close(i)
                else:
                    raise Malformed(c)
        if self.state in (_KEY, _STRING, _CONTAINER, _SCALAR_VALUE):  # a value began at the delta's end
            self._take(s, seg, stop)
        return None

    def _close(self, i: int) -> int:
        self.state = _DONE
        return i + 1

    def _start_value(self, c: str) -> None:
        key = self._key
        if key == "name":
            if self.name is not None:  # a second name: which one went out could not be taken back
                raise Malformed("two names")
            self._role, self._capture = "name", []
        elif key in self.args_keys and not self._args_seen:
            if c != "{":
                raise Malformed(key)
            self._role, self._args_seen = "args", True
        else:
            self._role = ""

    def _take(self, s: str, a: int, b: int) -> None:
        """s[a:b] is part of the key or value being read."""
        if a >= b:
            return
        if self.state == _KEY or self._role == "name":
            self._capture.append(s[a:b])
        elif self._role == "args":
            if self._held_args is None:
                self.out.args(s[a:b])
            else:
                self._held_args.append(s[a:b])

    def _value_done(self) -> None:
        self.state = _AFTER_VALUE
        if self._role == "name":
            name = loads("".join(self._capture))
            if not isinstance(name, str):
                raise Malformed("name")
            self.name = name
            self.out.call(name)
            held, self._held_args = self._held_args, None
            if held:
                self.out.args("".join(held))
        self._role, self._capture = "", []

    def _complete(self) -> None:
        loads("".join(self._parts))  # the whole object must be JSON
        if self.name is None:
            raise Malformed("no name")
        if not self._args_seen:
            self.out.args("{}")

    def _string(self, s: str, i: int, stop: int) -> int | None:
        """Reads a string's body from s[i] on; the index past its closing quote, or None."""
        if self._esc:
            self._esc = False
            i += 1
            self.chars_scanned += 1
        while i < stop:
            m = _STR_STOP.search(s, i, stop)
            if m is None:
                self.chars_scanned += stop - i
                return None
            j = m.start()
            self.chars_scanned += j - i + 1
            if s[j] == '"':
                return j + 1
            if j + 1 == stop:  # the escaped character is in the next delta
                self._esc = True
                return None
            i = j + 2
            self.chars_scanned += 1
        return None

    def _container(self, s: str, i: int, stop: int) -> int | None:
        """Reads an array or object value from s[i] on; the index past its end, or None."""
        stack = self._stack
        while i < stop:
            if self._in_str:
                e = self._string(s, i, stop)
                if e is None:
                    return None
                self._in_str = False
                i = e
                continue
            m = _CONTAINER_STOP.search(s, i, stop)
            if m is None:
                self.chars_scanned += stop - i
                return None
            j = m.start()
            self.chars_scanned += j - i + 1
            c = s[j]
            i = j + 1
            if c == '"':
                self._in_str = True
            elif c in _CLOSE:
                stack.append(_CLOSE[c])
            else:
                if c != stack.pop():
                    raise Malformed(c)
                if not stack:
                    return i
        return None
