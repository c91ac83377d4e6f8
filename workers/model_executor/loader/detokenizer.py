"""Incremental detokenization with stop strings.

Text is decoded a few tokens at a time (a window from `prefix_offset`), so a
token that completes a multi-byte character is emitted only once whole, and
the cost per token does not grow with the length of the reply. As in vLLM, the
window waits while its text ends in U+FFFD (a character still incomplete) or
adds nothing; unlike vLLM it waits at most MAX_PENDING tokens, so a run of
bytes that never make a character (a logit_bias on a byte token) costs time
linear in its length, not quadratic.
"""

from __future__ import annotations

import weakref

from shoal.proto.errors import InvalidRequestError
from shoal.proto.tokenizer import Tokenizer

# Tokens a window may wait for its text to complete. A character is at most 4
# UTF-8 bytes, so a wait longer than this is bytes that never make one.
MAX_PENDING = 16
# Tokens kept waiting when a long wait is cut short: they may hold the first
# bytes (at most 3) of a character still to complete.
KEEP_PENDING = 3
_special_ids: weakref.WeakKeyDictionary[Tokenizer, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that skip_special_tokens drops before decoding (computed once
    per tokenizer)."""
    ids = _special_ids.get(tokenizer)
    if ids is None:
        backend = getattr(tokenizer, "backend", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        ids = _special_ids[tokenizer] = frozenset(i for i, t in added.items() if t.special)
    return ids


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little context for spacing rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip = skip_special_tokens
        # Skipped special tokens add no text in any context: they never enter
        # the window, so the bytes of one character stay within a few tokens.
        self.skipped = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.stop = stop
        # Text that might be the start of a stop string is held back.
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far
        self.sent = 0  # how much of it has been handed out

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add a token. Returns the stop string if the text now holds one
        (the text is cut just before it)."""
        if token_id in self.skipped:
            return None
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        elif len(self.ids) - self.read_offset > MAX_PENDING:
            new = self._cut_wait(prefix, full)
        else:
            return None
        if not new:
            return None
        start = max(len(self.text) - self.hold, 0)
        self.text += new
        hits = check_stop and [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)
            self.text = self.text[:i]
            return s
        return None

    def _cut_wait(self, prefix: str, full: str) -> str:
        """Ends a wait of more than MAX_PENDING tokens; returns the new text.
        Each call costs a few window decodes and shortens the wait to at most
        KEEP_PENDING tokens, so the window stays under ~2 * MAX_PENDING."""
        if full == prefix:
            # The waiting tokens decode to nothing at all: drop them rather
            # than let them widen every later decode.
            del self.ids[self.read_offset :]
            return ""
        # Emit all but the last KEEP_PENDING tokens, cut where the shorter
        # decode is a prefix of the longer one: bytes there never complete a
        # character (each cut tried costs one window decode).
        end = len(self.ids)
        for cut in range(end - KEEP_PENDING, max(end - KEEP_PENDING - 4, self.read_offset), -1):
            head = self.tokenizer.decode(self.ids[self.prefix_offset : cut], self.skip)
            if len(head) > len(prefix) and full.startswith(head):
                self.prefix_offset, self.read_offset = self.read_offset, cut
                return head[len(prefix) :]
        # No clean cut: emit the window as it stands and move on.
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full[len(prefix) :]

    def resume(self, output_ids: list[int], num_sent_chars: int) -> None:
        """Take up a reply begun on another worker: replay its tokens (their
        stops were checked there) to the same text and offsets, and count its
        first num_sent_chars characters as handed out already."""
        for token_id in output_ids:
            self.add(token_id, check_stop=False)
        if not 0 <= num_sent_chars <= len(self.text):
            raise InvalidRequestError(
                f"{num_sent_chars} characters were sent of a reply that has {len(self.text)}", field="num_resumed_chars"
            )
        self.sent = num_sent_chars

    def take(self, finished: bool) -> str:
        """The text not yet handed out (all of it once finished)."""
        end = len(self.text) if finished else max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out
