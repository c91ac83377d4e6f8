"""A GGUF file's SentencePiece vocabulary ('llama' in tokenizer.ggml.model)
as a `tokenizers` BPE with byte fallback, built as transformers builds it
from the same file (integrations/gguf: GemmaTokenizer's shape, merges
recovered from the vocabulary), so both encode a text alike.

The file lists no merges. Every split of a token into two vocabulary
pieces is a merge, ranked by the token's place in the vocabulary (Gemma's
scores do not follow its merge order; the order of the tokens does), and
among one token's splits the longer left piece first.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # SentencePiece's visible space
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for token in sorted(vocab, key=vocab.__getitem__):
        pairs = ((token[:i], token[i:]) for i in range(len(token) - 1, 0, -1))
        merges.extend((left, right) for left, right in pairs if left in vocab and right in vocab)
    return merges


def sentencepiece_backend(md: dict[str, Any]) -> HFTokenizer:
    # A token of two or more spaces is stored with real spaces; the normalizer
    # turns spaces into SPACE before lookup, so it is looked up respelled.
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in md["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}  # a respelled duplicate keeps the later id, as transformers
    unk = md.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(vocab),
            fuse_unk=True,
            unk_token=tokens[unk] if unk is not None else None,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens are matched whole and special; user-defined ones (runs of
    # newlines or tabs) whole but plain, where the vocabulary spells them so.
    original, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens(
        [AddedToken(original[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(original[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == _USER_DEFINED and original[i] in vocab
        ]
    )
    return backend
