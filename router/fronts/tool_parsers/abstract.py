"""What a tool-call parser returns, and the one streaming driver every format shares.

A format gives a `Reader`: fed a reply's text one delta at a time, it keeps its place
between deltas and reports content it is sure of, each call's name once complete and its
argument fragments (the model's own JSON text, sliced, never re-dumped), so a delta costs
time in proportion to its own length, not to the reply so far. A whole reply is the same
reader fed once, so the fragments a stream sends concatenate to exactly what
`extract_tool_calls` returns. A reader raises Malformed when the text cannot be calls.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from shoal.router.fronts.tool_parsers.json_scan import CallScanner, Malformed, Out

_ALNUM = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """OpenAI's shape (`call_` + 24 alphanumerics), not vLLM's `chatcmpl-tool-...`."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaToolCall:
    index: int
    id: str | None  # set, with name, on a call's first delta only
    name: str | None
    arguments: str  # a fragment; a call's fragments concatenate to its arguments


@dataclass
class DeltaMessage:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class Reader:
    """One reply of one format, read as it arrives. `feed` takes the next delta, `finish`
    says the reply ended; both report to `out` and raise Malformed for text that is not
    calls. `chars_scanned` counts the characters looked at (each once)."""

    def __init__(self, out: Out):
        self.out = out
        self._scanned = 0
        self._scanner: CallScanner | None = None  # the call object being read

    @property
    def chars_scanned(self) -> int:
        return self._scanned + (0 if self._scanner is None else self._scanner.chars_scanned)

    def feed(self, s: str) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def _new_scanner(self, args_keys: tuple[str, ...]) -> CallScanner:
        self._retire_scanner()
        self._scanner = CallScanner(self.out, args_keys)
        return self._scanner

    def _retire_scanner(self) -> None:
        if self._scanner is not None:
            self._scanned += self._scanner.chars_scanned
            self._scanner = None


class ToolParser:
    """One output format; `reader()` gives the per-reply state."""

    name = ""

    def reader(self, out: Out) -> Reader:
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        got = _Collect(model_output)
        reader = self.reader(got)
        try:
            if model_output:
                reader.feed(model_output)
            reader.finish()
        except Malformed:
            return ExtractedToolCalls(False, [], model_output)
        if not got.calls:
            return ExtractedToolCalls(False, [], model_output)
        calls = [ToolCall(make_tool_call_id(), name, "".join(parts)) for name, parts in got.calls]
        return ExtractedToolCalls(True, calls, "".join(got.contents) or None)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class _Collect(Out):
    """A whole reply's content and calls."""

    def __init__(self, text: str):
        self._text = text
        self.contents: list[str] = []
        self.calls: list[tuple[str, list[str]]] = []

    def text(self) -> str:
        return self._text

    def content(self, text: str) -> None:
        self.contents.append(text)

    def call(self, name: str) -> None:
        self.calls.append((name, []))

    def args(self, fragment: str) -> None:
        self.calls[-1][1].append(fragment)


class ToolCallStream(Out):
    """Fed a reply's text deltas; returns content and tool-call deltas (name first, then arguments).

    Each step is all or nothing: when the reader finds the text malformed, what it reported
    during that delta is dropped. Malformed output found before any call went out becomes
    content, as whole-reply extraction gives (the rest of the reply passes through as content).
    Found after (a call's arguments turned out invalid, or the reply ended mid-call), the calls
    already streamed cannot be taken back: the stream goes quiet and `malformed` says so.
    """

    def __init__(self, parser: ToolParser):
        self._parts: list[str] = []  # the reply so far, joined only when it must pass through whole
        self._content_sent = 0
        self.ids: list[str] = []
        self.malformed = False
        self.plain = False  # read as plain content from here on
        self._step_content: list[str] = []
        self._step_calls: list[DeltaToolCall] = []
        self._step_args: list[list[str]] = []
        self._step_new = 0
        self.reader = parser.reader(self)

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    @property
    def chars_scanned(self) -> int:
        return self.reader.chars_scanned

    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, delta_text: str) -> DeltaMessage | None:
        self._parts.append(delta_text)
        if self.plain:
            return DeltaMessage(delta_text) if delta_text else None
        if self.malformed:
            return None
        return self._step(self.reader.feed, delta_text)

    def finish(self) -> DeltaMessage | None:
        if self.plain or self.malformed:
            return None
        return self._step(self.reader.finish)

    def give_up(self) -> DeltaMessage | None:
        """The reply is not calls: before any call went out, what content has not gone out
        yet does now (and the rest will pass through); after, the stream goes quiet."""
        if self.plain or self.malformed:
            return None
        if self.ids:
            self.malformed = True
            return None
        self.plain = True
        rest = self.text()[self._content_sent :]
        self._content_sent += len(rest)
        return DeltaMessage(rest) if rest else None

    def _step(self, fn, *args) -> DeltaMessage | None:
        self._step_content, self._step_calls, self._step_args, self._step_new = [], [], [], 0
        try:
            fn(*args)
        except Malformed:
            return self.give_up()
        content = "".join(self._step_content)
        self._content_sent += len(content)
        for d, frags in zip(self._step_calls, self._step_args):
            d.arguments = "".join(frags)
            if d.id is not None:
                self.ids.append(d.id)
        if not content and not self._step_calls:
            return None
        return DeltaMessage(content or None, self._step_calls)

    # ---- Out: what the reader reports during a step -------------------------

    def content(self, text: str) -> None:
        self._step_content.append(text)

    def call(self, name: str) -> None:
        self._step_calls.append(DeltaToolCall(len(self.ids) + self._step_new, make_tool_call_id(), name, ""))
        self._step_args.append([])
        self._step_new += 1

    def args(self, fragment: str) -> None:
        index = len(self.ids) + self._step_new - 1
        if self._step_calls and self._step_calls[-1].index == index:
            self._step_args[-1].append(fragment)
        else:
            self._step_calls.append(DeltaToolCall(index, None, None, ""))
            self._step_args.append([fragment])
