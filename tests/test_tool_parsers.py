"""Tool-call parsers on canned model outputs: whole replies, and the same replies
streamed cut at every split point, one character at a time and at random splits,
giving the same calls (names, arguments) and content; long arguments streamed with
each character scanned once; malformed output as plain content, never an exception."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.router.fronts.tool_parsers import TOOL_PARSERS, ExtractedToolCalls, get_tool_parser
from shoal.router.fronts.tool_replies import NamedToolParser, RequiredToolParser, ToolReply
from shoal.router.fronts.tools import ToolChoice

NESTED = {"city": "Paris", "when": {"day": "mardi", "hours": [9, 12.5]}, "ok": True, "none": None}
TRICKY = {"q": 'say "hi" \\ bye', "u": "héllo ✓ 東京", "n": -1.5e3}

# (format, model output, expected calls as (name, arguments), expected content)
CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [("get_weather", {"city": "Paris"})],
        None,
    ),
    (
        "hermes",
        'Let me look.\n<tool_call>{"name": "a", "arguments": ' + json.dumps(NESTED) + "}</tool_call>\n"
        '<tool_call>{"arguments": ' + json.dumps(TRICKY, ensure_ascii=False) + ', "name": "b"}</tool_call>',
        [("a", NESTED), ("b", TRICKY)],
        "Let me look.\n",
    ),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', [("f", {})], None),
    ("hermes", 'x <tool_call>{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})], "x "),  # stop ate the tag
    ("hermes", "The answer is 4 < 5 and <tool_ is not a tag.", [], None),
    ("hermes", "<tool_call>not json</tool_call>", [], None),
    ("hermes", '<tool_call>{"name": 5, "arguments": {}}</tool_call>', [], None),
    ("hermes", 'Hi <tool_call>{"name": "get_wea', [], None),
    ("hermes", "<tool_call></tool_call>", [], None),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [("get_weather", {"city": "Paris"})],
        None,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": '
        + json.dumps(NESTED)
        + '}; {"name": "b", "arguments": '
        + json.dumps(TRICKY, ensure_ascii=False)
        + "}",
        [("a", NESTED), ("b", TRICKY)],
        None,
    ),
    ("llama3_json", ' {"name": "f", "parameters": {}};', [("f", {})], None),
    ("llama3_json", "The weather in Paris is sunny.", [], None),
    ("llama3_json", "<|python_tag|>", [], None),
    ("llama3_json", '{"answer": 42}', [], None),
    ("llama3_json", "{'name': 'f'}", [], None),
    ("llama3_json", '{"name": 42, "parameters": {}}', [], None),
    ("pythonic", '[get_weather(city="Paris")]', [("get_weather", {"city": "Paris"})], None),
    (
        "pythonic",
        "[a(city='Paris', when={'day': 'mardi', 'hours': [9, 12.5]}, ok=True, none=None), "
        'b(q=\'say "hi" \\\\ bye\', u="héllo ✓ 東京", n=-1.5e3)]',
        [("a", NESTED), ("b", TRICKY)],
        None,
    ),
    ("pythonic", " [f(), g(x=(1, 2)),]\n", [("f", {}), ("g", {"x": [1, 2]})], None),
    ("pythonic", "I cannot call tools [yet].", [], None),
    ("pythonic", "[1, 2]", [], None),
    ("pythonic", "[os.system(cmd='rm')]", [], None),
    ("pythonic", "[]", [], None),
]


def _expected_content(output, calls, content):
    return content if calls else output  # no call: the whole reply is content


def _stream(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    s = get_tool_parser(fmt).stream()
    content, names, args, ids = "", {}, {}, {}
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        if d is None:
            continue
        content += d.content or ""
        for tc in d.tool_calls:
            if tc.id is not None:  # the first delta of a call: id and name, once
                assert tc.index not in ids and tc.name
                ids[tc.index], names[tc.index], args[tc.index] = tc.id, tc.name, ""
            else:
                assert tc.name is None and tc.index in ids
            args[tc.index] += tc.arguments
    assert sorted(ids) == list(range(len(ids)))
    return content, [(names[i], args[i]) for i in sorted(ids)], s.tools_called


@pytest.mark.parametrize("fmt,output,calls,content", CASES)
def test_whole_reply(fmt, output, calls, content):
    r = get_tool_parser(fmt).extract_tool_calls(output)
    assert isinstance(r, ExtractedToolCalls)
    assert r.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == calls
    assert r.content == _expected_content(output, calls, content)
    for c in r.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id)
    assert len({c.id for c in r.tool_calls}) == len(r.tool_calls)


@pytest.mark.parametrize("fmt,output,calls,content", CASES)
def test_streamed_at_every_split_equals_whole(fmt, output, calls, content):
    whole = get_tool_parser(fmt).extract_tool_calls(output)
    want = ([(c.name, c.arguments) for c in whole.tool_calls], whole.content or "", whole.tools_called)
    splits = [[output[:k], output[k:]] for k in range(len(output) + 1)] + [list(output), [output]]
    for pieces in splits:
        got_content, got_calls, called = _stream(fmt, pieces)
        assert (got_calls, got_content, called) == want, pieces


@pytest.mark.parametrize(
    "fmt,output",
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some text'),
        ("pythonic", "[f(x=y)]"),
        ("pythonic", "[f(x=1)] trailing"),
    ],
)
def test_malformed_after_a_call_went_out(fmt, output):
    """Whole: plain content. Streamed: the call already sent stays, and the stream says the rest was malformed."""
    r = get_tool_parser(fmt).extract_tool_calls(output)
    assert (r.tools_called, r.tool_calls, r.content) == (False, [], output)
    s = get_tool_parser(fmt).stream()
    for ch in output:
        s.feed(ch)
    s.finish()
    assert s.tools_called and s.malformed


def test_first_delta_carries_the_name_then_argument_fragments():
    s = get_tool_parser("hermes").stream()
    first = s.feed('<tool_call>{"name": "get_weather", ')
    assert first is not None and first.content is None
    (tc,) = first.tool_calls
    assert (tc.index, tc.name, tc.arguments) == (0, "get_weather", "") and tc.id.startswith("call_")
    frag = s.feed('"arguments": {"city": "Pa')
    assert [(t.index, t.id, t.name, t.arguments) for t in frag.tool_calls] == [(0, None, None, '{"city": "Pa')]


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "pythonic"}
    assert get_tool_parser("pythonic").name == "pythonic"
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic") as e:
        get_tool_parser("mistral")
    assert "mistral" in str(e.value)


# ---- incremental reading: each delta costs in proportion to itself -----------

LONG = {"text": ('say "hi" \\ é ' + "a" * 60) * 2800, "n": [1, {"k": None}]}  # ~210 KB of arguments


def _long(fmt: str) -> tuple[object, str, str]:
    """A parser, a reply holding one call with LONG's ~210 KB arguments, and those arguments' text."""
    args = json.dumps(LONG, ensure_ascii=False)
    if fmt == "hermes":
        return get_tool_parser(fmt), f'Sure. <tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>', args
    if fmt == "llama3_json":
        return get_tool_parser(fmt), f'<|python_tag|>{{"name": "write", "parameters": {args}}}', args
    if fmt == "required":
        return RequiredToolParser(), f'[{{"name": "write", "parameters": {args}}}]', args
    if fmt == "named":
        return NamedToolParser("write"), " " + args, args
    text = LONG["text"]
    return get_tool_parser(fmt), f"[write(text={text!r}, n=[1, {{'k': None}}])]", json.dumps(LONG, ensure_ascii=False)


@pytest.mark.parametrize(
    "fmt,step",
    [("hermes", 1), ("hermes", 4), ("llama3_json", 4), ("required", 1), ("required", 4), ("named", 4), ("pythonic", 4)],
)
def test_streaming_a_long_argument_scans_each_character_once(fmt, step):
    """Re-reading the reply at each delta looks at ~n²/2step characters (10¹⁰ here); the
    readers keep their place, so the count stays within a constant of the reply's length
    (plus the few characters a tag may straddle, per delta)."""
    parser, output, args = _long(fmt)
    s = parser.stream()
    sent = []
    for k in range(0, len(output), step):
        d = s.feed(output[k : k + step])
        sent += [] if d is None else d.tool_calls
    d = s.finish()
    sent += [] if d is None else d.tool_calls
    deltas = -(-len(output) // step)
    assert s.chars_scanned <= 2 * len(output) + 16 * deltas, (s.chars_scanned, len(output))
    assert s.chars_scanned >= len(output)  # the counter counts every character
    assert [tc.name for tc in sent if tc.id] == ["write"] and not s.malformed
    assert "".join(tc.arguments for tc in sent) == args == parser.extract_tool_calls(output).tool_calls[0].arguments


# ---- random splits and random arguments: the stream gives the whole reply's calls ----

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=12,
)


def _pieces(data, text: str) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=16), label="cuts"))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _stream_with(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    s = parser.stream()
    content, calls = "", {}
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        if d is None:
            continue
        content += d.content or ""
        for tc in d.tool_calls:
            if tc.id is not None:
                calls[tc.index] = [tc.name, ""]
            calls[tc.index][1] += tc.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], s.tools_called


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_split_of_the_known_replies_gives_their_calls_and_content(data):
    fmt, output, calls, content = data.draw(st.sampled_from(CASES), label="case")
    got_content, got_calls, called = _stream(fmt, _pieces(data, output))
    assert [(n, json.loads(a)) for n, a in got_calls] == calls and called == bool(calls)
    assert got_content == (_expected_content(output, calls, content) or "")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), args=st.lists(st.dictionaries(st.text(max_size=6), _JSON, max_size=4), min_size=1, max_size=3))
def test_streamed_argument_fragments_concatenate_to_the_whole_replys_arguments(data, args):
    fmt = data.draw(st.sampled_from(["hermes", "llama3_json", "required"]), label="fmt")
    ascii_only = data.draw(st.booleans(), label="ascii")
    sep = data.draw(st.sampled_from([(", ", ": "), (",", ":"), (",\n  ", " : ")]), label="separators")
    texts = [json.dumps(a, ensure_ascii=ascii_only, separators=sep) for a in args]
    key = {"hermes": "arguments", "llama3_json": "parameters", "required": "parameters"}[fmt]
    objs = [f'{{"name": "f{k}", "{key}": {t}}}' for k, t in enumerate(texts)]
    if fmt == "hermes":
        output = "Hi " + "\n".join(f"<tool_call>{o}</tool_call>" for o in objs)
        parser = get_tool_parser(fmt)
    elif fmt == "llama3_json":
        output, parser = "; ".join(objs), get_tool_parser(fmt)
    else:
        output, parser = "[" + ", ".join(objs) + "]", RequiredToolParser()
    whole = parser.extract_tool_calls(output)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [(f"f{k}", t) for k, t in enumerate(texts)]
    content, calls, called = _stream_with(parser, _pieces(data, output))
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls] and called
    assert [json.loads(a) for _, a in calls] == args
    assert content == (whole.content or "")


# ---- malformed model output: plain content, never an exception ------------------

MALFORMED = [
    ("hermes", '<tool_call>{"name": 1}</tool_call>'),
    ("hermes", '<tool_call>{"name": tru}</tool_call>'),  # json.loads raised here
    ("hermes", '<tool_call>{"na\\qme": "f"}</tool_call>'),  # and here (an invalid escape in a key)
    ("hermes", 'Hi <tool_call>{"name": "get_wea'),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"a": [}]}, "name": "f"}</tool_call>'),
    ("hermes", "<tool_call>\n</tool_call>"),
    ("llama3_json", "[1, 2]"),
    ("llama3_json", '{"parameters": [1, 2], "name": "f"}'),
    ("llama3_json", '{"name": 1.2.3}'),  # json.loads raised here
    ("pythonic", '[get weather(city="Paris")]'),
    ("pythonic", "[1 +]"),
]
# Malformed only after the call's name is complete: whole (or streamed in one piece), plain content.
MALFORMED_LATE = [
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>'),  # which name?
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"),
    ("required", '[{"name": "f", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}]"),
    ("pythonic", "[f(x=1e999)]"),  # Infinity is not JSON
    ("pythonic", "[f(x=" + "(" * 300 + ")" * 300 + ")]"),
]


@pytest.mark.parametrize("fmt,output", MALFORMED + MALFORMED_LATE)
def test_malformed_whole_reply_is_plain_content(fmt, output):
    """Nesting too deep for json.loads (a RecursionError before) is malformed too."""
    choice = ToolChoice("required") if fmt == "required" else ToolChoice("auto")
    reply = ToolReply(choice, None if fmt == "required" else fmt)
    assert reply.whole(output, "stop") == {"content": output, "tool_calls": None, "finish_reason": "stop"}
    reply = ToolReply(choice, None if fmt == "required" else fmt)
    parts = reply.feed(output, True)
    assert all(set(p) == {"content"} for p in parts) and "".join(p["content"] for p in parts) == output


@pytest.mark.parametrize("fmt,output", MALFORMED)
def test_malformed_output_is_plain_content_whole_and_streamed(fmt, output):
    reply = ToolReply(ToolChoice("auto"), fmt)
    assert reply.whole(output, "stop") == {"content": output, "tool_calls": None, "finish_reason": "stop"}
    for step in (1, 3, len(output)):
        reply = ToolReply(ToolChoice("auto"), fmt)
        parts = []
        for k in range(0, len(output), step):
            parts += reply.feed(output[k : k + step], k + step >= len(output))
        assert all(set(p) == {"content"} for p in parts), parts
        assert "".join(p["content"] for p in parts) == output
        assert not reply.called and reply.finish_reason("stop", reply.called) == "stop"


class _Buggy(Exception):
    pass


def test_a_parser_bug_is_contained_the_reply_passes_on_as_content(monkeypatch):
    """Any exception out of a parser (not only Malformed) leaves the request whole:
    content before any call went out, a quiet stream after."""
    from shoal.router.fronts.tool_parsers.hermes import HermesReader

    def boom(self, s):
        if "!" in s:
            raise _Buggy(s)
        return real(self, s)

    real = HermesReader.feed
    monkeypatch.setattr(HermesReader, "feed", boom)
    text = "Hello <tool_c" + "all>!"
    reply = ToolReply(ToolChoice("auto"), "hermes")
    assert reply.whole(text, "length") == {"content": text, "tool_calls": None, "finish_reason": "length"}
    reply = ToolReply(ToolChoice("auto"), "hermes")
    out = reply.feed("Hello <tool_c", False) + reply.feed("all>!", False) + reply.feed(" more", True)
    assert "".join(p["content"] for p in out) == text + " more" and not reply.called

    reply = ToolReply(ToolChoice("auto"), "hermes")
    out = reply.feed('<tool_call>{"name": "f", "arguments": {"a', False)
    assert out[0]["tool_calls"][0]["function"]["name"] == "f"
    assert reply.feed('!"}}</tool_call>', True) == [] and reply.called  # a call went out: it stays, quietly
