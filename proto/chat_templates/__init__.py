"""Chat templates shoal ships for models whose files carry none (a GGUF
converted without one): Gemma's turn format for Gemma 3."""

from __future__ import annotations

from importlib.resources import files

# general.architecture (GGUF) -> the template file here
_TEMPLATES = {"gemma3": "gemma3.jinja"}


def fallback_chat_template(architecture: str) -> str | None:
    """The template for a model of `architecture` that came without one; None where shoal has none."""
    name = _TEMPLATES.get(architecture)
    return None if name is None else files(__name__).joinpath(name).read_text()
