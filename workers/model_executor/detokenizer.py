"""Incremental detokenization with stop strings.

Text is decoded a few tokens at a time (a window from `prefix_offset`), so a
token that completes a multi-byte character is emitted only once whole, and
the cost per token does not grow with the length of the reply.
"""

from __future__ import annotations

from shoal.workers.errors import InvalidRequestError
from shoal.workers.model_executor.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little context for spacing rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip = skip_special_tokens
        self.stop = stop
        # Text that might be the start of a stop string is held back.
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text so far
        self.sent = 0  # how much of it has been handed out

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add a token. Returns the stop string if the text now holds one
        (the text is cut just before it)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(len(self.text) - self.hold, 0)
            self.text += new
            hits = check_stop and [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                return s
        return None

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
