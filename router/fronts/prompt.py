"""A prompt as a client sends it, and how the router turns it into token ids."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.proto.errors import InvalidRequestError


@dataclass(slots=True)
class Prompt:
    """Exactly one of text, token_ids or messages is set."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict] | None = None  # tools.parse_messages, rendered with the chat template
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: True for text, False for chat (the template has them)
    tools: list[dict] | None = None  # chat: the tool definitions, rendered by the template as transformers does


def tokenize(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids as the engine would make them from the same text."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send token ids", field="prompt")
    if prompt.messages is not None:
        if not tokenizer.chat_template:
            raise InvalidRequestError("this model has no chat template: use the completions API", field="messages")
        try:
            text = tokenizer.apply_chat_template(
                prompt.messages, add_generation_prompt=prompt.add_generation_prompt, tools=prompt.tools
            )
        except Exception as e:  # the template's own raise_exception, e.g. bad role order
            raise InvalidRequestError(f"the chat template refused the messages: {e}", field="messages") from None
        special = bool(prompt.add_special_tokens)
    else:
        text = prompt.text or ""
        special = prompt.add_special_tokens is not False
    return tokenizer.encode(text, add_special_tokens=special)
