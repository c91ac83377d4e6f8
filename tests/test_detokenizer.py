"""The incremental detokenizer stays linear on any byte sequence: a long run of
bytes that never make a character (what a logit_bias on a byte token gives)
costs a bounded number of decoded tokens per token, and the text is still the
full decode. Two tiny tokenizers cover both byte schemes: byte-level BPE
(GPT-2, SmolLM2) and SentencePiece byte fallback (Llama 2, Gemma)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shoal.proto.tokenizer import Tokenizer
from shoal.workers.model_executor.loader.detokenizer import IncrementalDetokenizer

SPACE = "\u2581"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


class Counting(Tokenizer):
    """Counts the tokens handed to decode: the detokenizer's work."""

    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def byte_level() -> tuple[Counting, dict]:
    """One token per byte (ids 0..255 are the bytes), plus <eos>."""
    stand_in = _bytes_to_unicode()
    backend = HFTokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    tok = Counting(backend, bos_token=None, eos_token="<eos>", add_bos_token=False, chat_template=None)
    return tok, {"byte": lambda b: b, "A": ord("A"), "context": [ord(" "), ord("A")]}


def byte_fallback() -> tuple[Counting, dict]:
    """SentencePiece's layout (<0xNN> byte tokens), decoded as the GGUF loader does."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), SPACE, "A", SPACE + "A"]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=[(SPACE, "A")], unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok = Counting(backend, bos_token="<s>", eos_token="</s>", add_bos_token=True, chat_template=None)
    return tok, {"byte": lambda b: 3 + b, "A": vocab["A"], "context": [vocab[SPACE + "A"]]}


TOKENIZERS = {"byte-level": byte_level, "byte-fallback": byte_fallback}


def stream(tok: Tokenizer, context: list[int], ids: list[int], stop: list[str] | None = None) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, context, stop or [], True)
    for t in ids:
        if d.add(t) is not None:
            break
    return d


def full_decode(tok: Tokenizer, context: list[int], ids: list[int]) -> str:
    """The reply's text as one decode of context + reply gives it."""
    return tok.decode(context + ids)[len(tok.decode(context)) :]


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_a_long_run_of_invalid_bytes_costs_linear_work(kind):
    tok, t = TOKENIZERS[kind]()
    n = 20_000
    ids = [t["byte"](0xFF)] * n + [t["A"]]
    d = stream(tok, t["context"], ids)
    # Each token decodes a window of at most ~2 * MAX_PENDING tokens twice; the
    # quadratic window decoded ~n**2 / 2 = 2e8 tokens here.
    assert tok.decoded <= 100 * len(ids), tok.decoded
    assert d.text == "\ufffd" * n + "A" == full_decode(tok, t["context"], ids)


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_skipped_special_tokens_never_widen_the_window(kind):
    tok, t = TOKENIZERS[kind]()
    n = 20_000
    euro = [t["byte"](b) for b in "€".encode()]
    # A character's bytes with thousands of skipped special tokens between them.
    ids = euro[:1] + [tok.eos_token_id] * n + euro[1:] + [t["A"]]
    d = stream(tok, t["context"], ids)
    assert tok.decoded <= 100 * len(ids), tok.decoded
    assert d.text == "€A" == full_decode(tok, t["context"], ids)


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("char", ["é".encode(), "€".encode(), "😀".encode(), b"\xc3", b"\xe2\x82", b"\xf0"])
def test_text_is_the_full_decode_wherever_a_long_wait_is_cut(kind, char):
    """Invalid bytes, then a character whose bytes straddle each possible cut
    point (or an incomplete one), then a plain token: the stream's text is
    the one-shot decode, with or without skipped special tokens in between."""
    tok, t = TOKENIZERS[kind]()
    tail = [t["byte"](b) for b in char]
    for k in range(45):
        for specials in ([], [tok.eos_token_id] * 20):
            ids = [t["byte"](0xFF)] * k + specials + tail + [t["A"]]
            assert stream(tok, t["context"], ids).text == full_decode(tok, t["context"], ids), (k, len(specials))


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_valid_text_one_byte_a_token_is_exact(kind):
    tok, t = TOKENIZERS[kind]()
    text = "naïve café — 東京 😀 ok " * 40
    ids = [t["byte"](b) for b in text.encode()]
    assert stream(tok, t["context"], ids).text == text == full_decode(tok, t["context"], ids)


def test_a_stop_string_after_invalid_bytes_is_found():
    tok, t = byte_level()
    ids = [0xFF] * 1000 + list(b"xSTOPy")
    d = stream(tok, t["context"], ids, stop=["STOP"])
    assert d.text == "\ufffd" * 1000 + "x"
