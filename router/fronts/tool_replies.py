"""Tools on the chat endpoint, reply side: one choice's reply read as tool
calls, whole or streamed, in OpenAI's shapes.

"required" and named replies are JSON the grammar made (tools.choice_schema);
auto replies are read by the --tool-call-parser. Every way shares the tool
parsers' stream (tool_parsers/abstract.py), so streamed argument fragments
concatenate to the whole reply's arguments: the model's own JSON text, sliced."""

from __future__ import annotations

import logging
from typing import cast

from shoal.router.fronts.tool_parsers import DeltaMessage, ToolParser, get_tool_parser
from shoal.router.fronts.tool_parsers.abstract import Reader
from shoal.router.fronts.tool_parsers.json_scan import CallScanner, Malformed, Out, skip_ws
from shoal.router.fronts.tools import ToolChoice

logger = logging.getLogger(__name__)


class NamedReader(Reader):
    """The whole reply is the named function's arguments object: the call goes out at once,
    the text after any leading whitespace is its arguments."""

    def __init__(self, out: Out, function: str):
        super().__init__(out)
        self.function = function
        self._started = False
        self._lead = True  # still in the leading whitespace

    def feed(self, s: str) -> None:
        self._start()
        self._scanned += len(s)
        if self._lead:
            s = s.lstrip()
            if not s:
                return
            self._lead = False
        self.out.args(s)

    def finish(self) -> None:
        self._start()

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self.out.call(self.function)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function: str):
        self.function = function

    def reader(self, out: Out) -> NamedReader:
        return NamedReader(out, self.function)


# where a required reply's reader is: before the `[`, after it, in a call, after a call, after a `,`, past the `]`
_LEAD, _LIST, _OBJECT, _AFTER_CALL, _NEXT, _DONE = range(6)


class RequiredReader(Reader):
    """The reply is `[{"name": ..., "parameters": {...}}, ...]`. A reply cut
    short (max_tokens) keeps the calls it named, the last one unfinished."""

    def __init__(self, out: Out):
        super().__init__(out)
        self.state = _LEAD
        self._calls = 0  # call objects complete

    def feed(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n and self.state != _DONE:
            st = self.state
            if st == _OBJECT:
                end = cast(CallScanner, self._scanner).feed(s, i, n)
                if end is None:
                    return
                self._retire_scanner()
                self._calls += 1
                self.state, i = _AFTER_CALL, end
                continue
            j = skip_ws(s, i, n)
            self._scanned += j - i + 1
            if j == n:
                return
            c, i = s[j], j + 1
            if st == _LEAD and c == "[":
                self.state = _LIST
            elif (st == _LIST and c == "]" and not self._calls) or (st == _AFTER_CALL and c == "]"):
                self.state = _DONE  # what follows the array is not read
            elif st in (_LIST, _NEXT) and c == "{":
                self._new_scanner(("parameters",))
                self.state = _OBJECT
            elif st == _AFTER_CALL and c == ",":
                self.state = _NEXT
            else:
                raise Malformed(c)

    def finish(self) -> None:
        named = self._calls + (self._scanner is not None and self._scanner.name is not None)
        if not named:
            raise Malformed("no call")


class RequiredToolParser(ToolParser):
    name = "required"

    def reader(self, out: Out) -> RequiredReader:
        return RequiredReader(out)


class ToolReply:
    """One choice's reply, read for tool calls (a parser per choice index)."""

    def __init__(self, choice: ToolChoice, auto_parser: str | None):
        self.choice = choice
        if choice.mode == "named":
            self.parser: ToolParser = NamedToolParser(cast(str, choice.name))
        elif choice.mode == "required":
            self.parser = RequiredToolParser()
        else:
            self.parser = get_tool_parser(cast(str, auto_parser))  # auto needs --tool-call-parser (checked)
        self.stream = self.parser.stream()
        self._broken = False  # the stream failed even to give up: new text passes through as is
        # auto without parallel_tool_calls: the first call only (the grammar bounds the others)
        self.max_calls = None if choice.parallel or choice.mode != "auto" else 1

    def whole(self, text: str, finish_reason: str) -> dict:
        """content, tool_calls (OpenAI's dicts) and finish_reason of a whole reply. A reply
        that is not calls, and any failure of the parser, give the text as plain content."""
        try:
            got = self.parser.extract_tool_calls(text)
        except Exception:  # a parser's bug must not fail the request: the reply is content
            logger.warning(
                "tool-call parser %r failed on a reply; it is passed on as content", self.parser.name, exc_info=True
            )
            got = None
        if got is None or not got.tools_called:
            return {"content": text, "tool_calls": None, "finish_reason": finish_reason}
        calls = got.tool_calls[: self.max_calls]
        return {
            # vLLM: "" beside a forced call, the text before the calls for auto
            "content": got.content if self.choice.mode == "auto" else "",
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ],
            "finish_reason": self.finish_reason(finish_reason, True),
        }

    def finish_reason(self, engine_reason: str, called: bool) -> str:
        """The reply's finish: tool_calls once its calls ended it (auto, required
        or named: a client checks for calls by it), and a reply cut short keeps
        "length" (vLLM would say tool_calls for a call the limit broke)."""
        if called and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def feed(self, text: str, final: bool) -> list[dict]:
        """The streamed deltas for the next text: a call's first piece holds
        its index, id, type and name with empty arguments; later pieces hold
        argument fragments."""
        if self._broken:
            return [] if self.called or not text else [{"content": text}]
        out: list[dict] = []
        try:
            if text:
                out += _deltas(self.stream.feed(text), self.max_calls)
            if final:
                out += _deltas(self.stream.finish(), self.max_calls)
        except Exception:  # a parser's bug must not cut the stream: what is left goes out as content
            logger.warning(
                "tool-call parser %r failed on a reply; it is passed on as content", self.parser.name, exc_info=True
            )
            try:
                out += _deltas(self.stream.give_up(), self.max_calls)
            except Exception:
                logger.exception("tool-call stream failed to pass a reply on as content")
                self._broken = True
                out += [] if self.called or not text else [{"content": text}]
        return out

    @property
    def called(self) -> bool:
        return self.stream.tools_called


def _deltas(d: DeltaMessage | None, max_calls: int | None) -> list[dict]:
    if d is None:
        return []
    out: list[dict[str, object]] = [{"content": d.content}] if d.content else []
    for tc in d.tool_calls:
        if max_calls is not None and tc.index >= max_calls:
            continue
        if tc.id is not None:
            head = {"index": tc.index, "id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
        if tc.arguments:
            out.append({"tool_calls": [{"index": tc.index, "function": {"arguments": tc.arguments}}]})
    return out


class ToolReplies(dict):
    """A ToolReply per choice index, made on first use."""

    def __init__(self, choice: ToolChoice, auto_parser: str | None):
        super().__init__()
        self.choice, self.auto_parser = choice, auto_parser

    def __missing__(self, index: int) -> ToolReply:
        reply = self[index] = ToolReply(self.choice, self.auto_parser)
        return reply
