"""Tools on the chat endpoint, reply side: one choice's reply read as tool
calls, whole or streamed, in OpenAI's shapes.

"required" and named replies are JSON the grammar made (tools.choice_schema);
auto replies are read by the --tool-call-parser. Every way shares the tool
parsers' stream (tool_parsers/abstract.py), so streamed argument fragments
concatenate to the whole reply's arguments: the model's own JSON text, sliced."""

from __future__ import annotations

from shoal.router.fronts.tool_parsers import DeltaMessage, ToolParser, get_tool_parser
from shoal.router.fronts.tool_parsers.abstract import ParseState, PartialCall
from shoal.router.fronts.tool_parsers.json_scan import Malformed, scan_call, skip_ws
from shoal.router.fronts.tools import ToolChoice


class NamedToolParser(ToolParser):
    """The whole reply is the named function's arguments object."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> ParseState:
        return ParseState(calls=[PartialCall(self.function, text.lstrip())])


class RequiredToolParser(ToolParser):
    """The reply is `[{"name": ..., "parameters": {...}}, ...]`. A reply cut
    short (max_tokens) keeps the calls it named, the last one unfinished."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParseState:
        st = ParseState()
        i = skip_ws(text, 0)
        if i == len(text):
            return ParseState(plain=final)
        try:
            if text[i] != "[":
                raise Malformed(text[i])
            i = skip_ws(text, i + 1)
            while i < len(text):
                if text[i] == "]" and not st.calls:
                    break
                call, end = scan_call(text, i, ("parameters",))
                st.calls.append(call)
                if end is None:
                    break
                i = skip_ws(text, end)
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
                elif i < len(text) and text[i] == "]":
                    break
                elif i < len(text):
                    raise Malformed(text[i])
        except Malformed:
            return ParseState(plain=True)
        if final:
            st.calls = [c for c in st.calls if c.name is not None]
            st.plain = not st.calls
        return st


class ToolReply:
    """One choice's reply, read for tool calls (a parser per choice index)."""

    def __init__(self, choice: ToolChoice, auto_parser: str | None):
        self.choice = choice
        if choice.mode == "named":
            self.parser: ToolParser = NamedToolParser(choice.name)
        elif choice.mode == "required":
            self.parser = RequiredToolParser()
        else:
            self.parser = get_tool_parser(auto_parser)
        self.stream = self.parser.stream()
        # auto without parallel_tool_calls: the first call only (the grammar bounds the others)
        self.max_calls = None if choice.parallel or choice.mode != "auto" else 1

    def whole(self, text: str, finish_reason: str) -> dict:
        """content, tool_calls (OpenAI's dicts) and finish_reason of a whole reply."""
        got = self.parser.extract_tool_calls(text)
        if not got.tools_called:
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
        d = self.stream.feed(text) if text else None
        out = _deltas(d, self.max_calls)
        if final:
            out += _deltas(self.stream.finish(), self.max_calls)
        return out

    @property
    def called(self) -> bool:
        return self.stream.tools_called


def _deltas(d: DeltaMessage | None, max_calls: int | None) -> list[dict]:
    if d is None:
        return []
    out = [{"content": d.content}] if d.content else []
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
