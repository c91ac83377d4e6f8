"""The two grammar libraries behind one seam (structured_output/backend.py):
on the tiny model's tokenizer, llguidance and xgrammar give the same token
masks, bit for bit in the same layout, along seeded walks through JSON
schemas, regexes, choices and grammars; where they differ, each difference
is pinned here (and listed in xgrammar_backend.py's docstring)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from prompts import SHORT_PROMPTS

from shoal.proto.errors import InvalidRequestError
from shoal.proto.structured_params import StructuredOutputsParams as SO
from shoal.workers import EngineArgs, SamplingParams
from shoal.workers.llm import LLM
from shoal.workers.model_executor.loader.model_loader import load_model_files
from shoal.workers.structured_output.guidance import GuidanceBackend

xgrammar_backend = pytest.importorskip(
    "shoal.workers.structured_output.xgrammar_backend", reason="xgrammar is optional and not installed"
)
pytest.importorskip("xgrammar", reason="xgrammar is optional and not installed")

# A tool call's arguments (strings unbounded: the walks close them).
WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
        "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "extra": {"anyOf": [{"type": "null"}, {"type": "number"}]},
    },
    "required": ["location", "unit", "days", "hourly", "tags"],
}
SPECS = {
    "json-tool-call": SO(json=WEATHER),
    "json-object": SO(json_object=True),
    "regex": SO(regex=r"[0-9]{1,3}(\.[0-9]+)? (yes|no)"),
    "choice": SO(choice=("yes", "no", "maybe", 'qu"ote')),
    "lark": SO(grammar='start: "ab" rest\nrest: "c" | "d" rest'),
    "gbnf": SO(grammar='root ::= "ab" rest\nrest ::= "c" | "d" rest'),
}


class Pair:
    def __init__(self, path: str):
        m = load_model_files(path)
        self.tok, self.vocab, self.eos = m.tokenizer.backend, m.config.vocab_size, list(m.config.eos_token_ids)
        self.guidance = GuidanceBackend(self.tok.to_str(), self.vocab, self.eos)
        self.xgrammar = xgrammar_backend.XgrammarBackend(self.tok, self.vocab, self.eos)
        special = set(self.tok.get_added_tokens_decoder())
        # Tokens of printable ASCII without a backslash (the tokenizer's own
        # decoding): the masks agree on all of these, and on EOS.
        self.text = {i: self.tok.decode([i]) for i in range(self.tok.get_vocab_size()) if i not in special}
        self.plain = np.zeros(self.vocab, dtype=bool)
        for i, s in self.text.items():
            self.plain[i] = bool(s) and all(" " <= c <= "~" and c != "\\" for c in s)
        self.plain[self.eos] = True

    def grammars(self, so: SO):
        return self.guidance.new_grammar(self.guidance.compile(so)), self.xgrammar.new_grammar(
            self.xgrammar.compile(so)
        )

    def masks(self, g, x) -> tuple[np.ndarray, np.ndarray]:
        """The allowed tokens (bool per token) of each, read bit j of word i = token 32i+j."""
        out = []
        for backend, grammar in ((self.guidance, g), (self.xgrammar, x)):
            bitmask = np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)
            backend.fill_bitmasks([(grammar, 0)], bitmask)
            out.append(np.array([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(self.vocab)], dtype=bool))
        return out[0], out[1]

    def accept(self, g, x, text: str) -> None:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        assert g.accept_tokens(ids) and x.accept_tokens(ids), text


@pytest.fixture(scope="module")
def pair(tiny_model) -> Pair:
    return Pair(tiny_model)


def test_the_masks_share_one_layout(pair):
    """At a choice's start, both allow exactly the tokens that begin a choice,
    each at bit t % 32 of word t // 32, and nothing else (EOS included)."""
    choice = ("yes", "quick", "Hello", "batching")
    g, x = pair.grammars(SO(choice=choice))
    a, b = pair.masks(g, x)
    expected = {t for t, s in pair.text.items() if s and any(c.startswith(s) for c in choice)}
    assert set(np.flatnonzero(a)) == set(np.flatnonzero(b)) == expected
    assert len({t // 32 for t in expected}) > 1  # more than one word is read
    # The raw words too, not only the bits read back: the padding bits past the vocab are the only freedom.
    words = []
    for backend, grammar in ((pair.guidance, g), (pair.xgrammar, x)):
        bitmask = np.full((2, pair.vocab // 32), -1, dtype=np.int32)
        backend.fill_bitmasks([(grammar, 1)], bitmask)
        assert (bitmask[0] == -1).all()  # another row is left alone
        words.append(bitmask[1])
    np.testing.assert_array_equal(words[0], words[1])


@pytest.mark.parametrize("name", list(SPECS))
def test_the_masks_agree_along_seeded_walks(pair, name):
    """Walk each spec by random plain tokens both allow (no '-': "-0", below),
    comparing masks at every state: equal on the plain tokens and EOS; where
    the grammar forces bytes that llguidance tokenizes, it allows their
    canonical first token alone, which xgrammar allows too. Both agree on
    complete and terminated."""
    so = SPECS[name]
    rng = random.Random(0)
    compared = forced = terminated = 0
    for _ in range(12):
        g, x = pair.grammars(so)
        for _ in range(80):
            a, b = pair.masks(g, x)
            if ff := g.matcher.compute_ff_tokens():
                forced += 1
                assert a.sum() == 1 and a[ff[0]] and b[ff[0]]
            else:
                compared += 1
                np.testing.assert_array_equal(a & pair.plain, b & pair.plain)
            choices = [
                int(t) for t in np.flatnonzero(a & b & pair.plain) if t not in pair.eos and "-" not in pair.text[t]
            ]
            if not choices:
                break
            closing = [t for t in choices if set(pair.text[t]) & set('"]}')]
            t = rng.choice(closing if closing and rng.random() < 0.4 else choices)  # so walks end
            assert g.accept_tokens([t]) and x.accept_tokens([t])
            assert (g.is_terminated(), g.is_accepting()) == (x.is_terminated(), x.is_accepting())
            if g.is_terminated():
                terminated += 1
                break
    assert compared >= 12 and terminated > 0, (compared, forced, terminated)


def test_the_known_differences(pair):
    """Each place the libraries part, pinned so that an upgrade that closes
    one shows here (and the docstring is corrected)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}}}
    bounded = {"type": "object", "properties": {"t": {"type": "string", "maxLength": 4}}}
    backslash = pair.tok.token_to_id("\\")
    control = [t for t, s in pair.text.items() if len(s) == 1 and ord(s) < 0x20 and s not in "\r\n"]
    (dl,) = [t for t, s in pair.text.items() if s == "\x7f"]

    def differ(so, text):
        g, x = pair.grammars(so)
        pair.accept(g, x, text)
        a, b = pair.masks(g, x)
        return set(np.flatnonzero(a & ~b)), set(np.flatnonzero(b & ~a))

    # DEL in a string, and the escapes \/ and \uXXXX beyond control characters: xgrammar only.
    assert differ(SO(json=schema), '{"a": "') == (set(), {dl})
    assert differ(SO(json=schema), '{"a": "\\') == (set(), {pair.tok.token_to_id("/")})
    only_guidance, only_xgrammar = differ(SO(json=schema), '{"a": "\\u')
    assert not only_guidance and pair.tok.token_to_id("a") in only_xgrammar
    # "-0": llguidance only.
    assert differ(SO(json=schema), '{"n": -') == ({pair.tok.token_to_id("0")}, set())
    # A string with maxLength: xgrammar has no escapes in it but raw control characters (less CR and LF).
    assert differ(SO(json=bounded), '{"t": "') == ({backslash}, {*control, dl})
    # Forced bytes: llguidance allows only the canonical first token.
    g, x = pair.grammars(SO(choice=("yes", "maybe")))
    pair.accept(g, x, "m")  # "aybe" forced: "ay" "be" as the tokenizer writes it, "a" "y" "be" too
    a, b = pair.masks(g, x)
    assert set(np.flatnonzero(a)) == {pair.tok.token_to_id("ay")}
    assert set(np.flatnonzero(b)) == {pair.tok.token_to_id("ay"), pair.tok.token_to_id("a")}


def test_terminated_means_nothing_but_the_end_can_follow(pair):
    """A regex that may go on is complete but not terminated; one that may
    not is terminated (xgrammar's own is_terminated waits for a stop token)."""
    g, x = pair.grammars(SO(regex="[0-9]+"))
    pair.accept(g, x, "12")
    assert (x.is_accepting(), x.is_terminated()) == (g.is_accepting(), g.is_terminated()) == (True, False)
    # The mask is_terminated made is the one the next fill gives: digits and EOS.
    a, b = pair.masks(g, x)
    np.testing.assert_array_equal(a, b)
    assert b[pair.eos].all() and b[pair.tok.token_to_id("3")]
    g, x = pair.grammars(SO(regex="ab"))
    pair.accept(g, x, "ab")
    assert x.is_terminated() and g.is_terminated()


@pytest.mark.parametrize("copies", [1, 4], ids=["on-the-callers-thread", "on-the-pool"])
def test_a_batch_fill_equals_each_row_alone(pair, copies):
    """fill_bitmasks writes rows in any order (on the caller's thread below
    BATCH_FILL_MIN_ROWS rows, else on xgrammar's threads; and rows that
    is_terminated already made), each as its grammar alone would."""
    states = [(SPECS["json-tool-call"], '{"location": "Par'), (SPECS["regex"], "12"), (SPECS["choice"], "")] * copies
    assert (len(states) < xgrammar_backend.BATCH_FILL_MIN_ROWS) == (copies == 1)
    grammars = []
    for so, text in states:
        g, x = pair.grammars(so)
        pair.accept(g, x, text)
        x.is_terminated()
        grammars.append(x)
    rows = random.Random(0).sample(range(len(states) + 1), len(states))
    (skipped,) = set(range(len(states) + 1)) - set(rows)
    bitmask = np.full((len(states) + 1, pair.vocab // 32), -1, dtype=np.int32)
    pair.xgrammar.fill_bitmasks(list(zip(grammars, rows)), bitmask)
    assert (bitmask[skipped] == -1).all()
    for x, row in zip(grammars, rows):
        alone = np.full((1, pair.vocab // 32), -1, dtype=np.int32)
        x.matcher.fill_next_token_bitmask(alone, 0)
        np.testing.assert_array_equal(bitmask[row], alone[0])


@pytest.mark.parametrize(
    "so",
    [SO(regex="(ab"), SO(grammar="start: (foo"), SO(grammar="root ::= foo"), SO(json={"$ref": "#/$defs/x"})],
    ids=["bad-regex", "bad-lark", "bad-gbnf", "missing-ref"],
)
def test_xgrammar_refusals_name_the_field(pair, so):
    so = SO(**{so.kind: getattr(so, so.kind)}, field="response_format")
    with pytest.raises(InvalidRequestError) as err:
        pair.xgrammar.compile(so)
    assert err.value.field == "response_format" and str(err.value).startswith("response_format: ")
    assert "/project/" not in str(err.value)  # the message, not xgrammar's source line


def test_the_engine_serves_json_on_xgrammar(tiny_model):
    """--structured-outputs-backend xgrammar, end to end: every seed's reply
    validates (enums, bounded integers and arrays: a random model closes no free string)."""
    schema = {
        "type": "object",
        "properties": {
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 0, "maximum": 30},
            "hourly": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        },
        "required": ["unit", "days", "hourly", "tags"],
        "additionalProperties": False,
    }
    ns = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--structured-outputs-backend", "xgrammar"]
    )
    assert EngineArgs.from_cli_args(ns).structured_outputs_backend == "xgrammar"
    with LLM(tiny_model, num_threads=1, num_kv_blocks=128, structured_outputs_backend="xgrammar") as llm:
        assert llm.engine.structured_output.backend.name == "xgrammar"
        outs = llm.generate(
            SHORT_PROMPTS[:6],
            [
                SamplingParams(structured_outputs=SO(json=schema), temperature=1.0, seed=s, max_tokens=64)
                for s in range(6)
            ],
        )
    texts = set()
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
        texts.add(o.text)
    assert len(texts) > 2
