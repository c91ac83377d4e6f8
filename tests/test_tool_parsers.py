"""Tool-call parsers on canned model outputs: whole replies, and the same replies
streamed cut at every split point and one character at a time, giving the same
calls (names, arguments) and content."""

from __future__ import annotations

import json
import re

import pytest

from shoal.router.fronts.tool_parsers import TOOL_PARSERS, ExtractedToolCalls, get_tool_parser

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
