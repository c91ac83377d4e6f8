"""What a tool-call parser returns, and the one streaming driver every format shares.

A format implements `parse(text, final)`: the reply so far read as content plus
calls, holding back whatever more text could still change. The stream re-reads
the whole reply at each delta and sends only what grew, so the fragments it
sends concatenate to exactly what `extract_tool_calls` returns for the whole
reply (the arguments are the model's own JSON text, sliced, never re-dumped).
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

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


@dataclass
class PartialCall:
    name: str | None  # None until the name is complete
    arguments: str  # the arguments text so far; only ever grows


@dataclass
class ParseState:
    """A reply (or a prefix of one) read by a format."""

    content: str = ""  # a prefix of the text: content outside the calls that is certain
    calls: list[PartialCall] = field(default_factory=list)
    plain: bool = False  # no tool call here (not the format, or malformed): all the text is content


class ToolParser:
    """One output format. Stateless: `stream()` gives the per-reply state."""

    name = ""

    def parse(self, text: str, final: bool) -> ParseState:
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        st = self.parse(model_output, final=True)
        if st.plain or not st.calls:
            return ExtractedToolCalls(False, [], model_output)
        calls = [ToolCall(make_tool_call_id(), c.name or "", c.arguments) for c in st.calls]
        return ExtractedToolCalls(True, calls, st.content or None)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Fed a reply's text deltas; returns content and tool-call deltas (name first, then arguments).

    Malformed output found before any call went out becomes content, as whole-reply extraction
    gives. Found after (a call's arguments turned out invalid, or the reply ended mid-call), the
    calls already streamed cannot be taken back: the stream goes quiet and `malformed` says so.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.ids: list[str] = []
        self._content_sent = 0
        self._args_sent: list[int] = []
        self.malformed = False

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta_text: str) -> DeltaMessage | None:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self) -> DeltaMessage | None:
        return self._advance(final=True)

    def _advance(self, final: bool) -> DeltaMessage | None:
        if self.malformed:
            return None
        st = self.parser.parse(self.text, final)
        if st.plain:
            if self.ids:
                self.malformed = True
                return None
            content = self.text
        else:
            content = st.content
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate([] if st.plain else st.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(make_tool_call_id())
                self._args_sent.append(0)
                deltas.append(DeltaToolCall(i, self.ids[i], call.name, ""))
            fragment = call.arguments[self._args_sent[i] :]
            if fragment:
                self._args_sent[i] = len(call.arguments)
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += fragment
                else:
                    deltas.append(DeltaToolCall(i, None, None, fragment))
        if not new_content and not deltas:
            return None
        return DeltaMessage(new_content or None, deltas)
