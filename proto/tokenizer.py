"""Tokenizer and chat template, from a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, NoReturn

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from shoal.proto.chat_templates import fallback_chat_template

if TYPE_CHECKING:
    from jinja2 import Template


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` with the special tokens
    and chat template that came with the model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None,
    ):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template: Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render chat messages to the prompt text the model was tuned on;
        `tools` (the tool definitions, as given) as transformers passes them."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> NoReturn:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = raise_exception
            # transformers' tojson: tool-use templates pass indent, separators or sort_keys
            env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
                x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
            )
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    @classmethod
    def from_hf_folder(cls, path: str) -> Tokenizer | None:
        """None when the folder has no tokenizer.json (token-id prompts only)."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            return None
        cfg: dict[str, Any] = {}
        if os.path.exists(os.path.join(path, "tokenizer_config.json")):
            with open(os.path.join(path, "tokenizer_config.json")) as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()

        def token(v: Any) -> Any:
            return v.get("content") if isinstance(v, dict) else v

        # Most tokenizer.json files add BOS in their post-processor already;
        # add_bos_token is honoured for those that do not (encode() checks).
        return cls(
            HFTokenizer.from_file(tok_file),
            bos_token=token(cfg.get("bos_token")),
            eos_token=token(cfg.get("eos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Byte-level BPE ('gpt2' in GGUF: SmolLM, Llama 3, Qwen2) or SentencePiece
        ('llama': Gemma 3; gguf_sentencepiece.py). A Gemma 3 file without a chat
        template gets Gemma's (chat_templates/)."""
        kind = md.get("tokenizer.ggml.model")
        tokens = md["tokenizer.ggml.tokens"]
        if kind == "llama":
            from shoal.proto.gguf_sentencepiece import sentencepiece_backend

            backend = sentencepiece_backend(md)
        elif kind == "gpt2":
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            backend.decoder = decoders.ByteLevel()
            # Control (3) and user-defined (4) tokens are matched whole, never split.
            types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
            backend.add_special_tokens(
                [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
            )
            backend.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == 4])
        else:
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' or SentencePiece 'llama')"
            )

        def tok(key: str) -> Any:
            i = md.get(key)
            return tokens[i] if i is not None and i < len(tokens) else None

        return cls(
            backend,
            bos_token=tok("tokenizer.ggml.bos_token_id"),
            eos_token=tok("tokenizer.ggml.eos_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=md.get("tokenizer.chat_template") or fallback_chat_template(md["general.architecture"]),
        )


def load_tokenizer(model: str | None) -> Tokenizer | None:
    """The tokenizer of a model (model_files.resolve_model's names and
    paths), read without its config or weights: a Hugging Face folder's
    tokenizer files, or a .gguf file's metadata. None where a folder has no
    tokenizer."""
    from shoal.proto.model_files import resolve_model

    path = resolve_model(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from shoal.proto.gguf_file import GGUFFile

        return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    if os.path.isdir(path):
        return Tokenizer.from_hf_folder(path)
    raise ValueError(f"{path}: expected a Hugging Face folder or a .gguf file")
