"""The router's check of a structured-output spec, by the llguidance library
without a tokenizer, and the budget it and a worker's compile run under
(workers/structured_output/guidance.py compiles with the same LIMITS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import llguidance

from shoal.proto.errors import InvalidRequestError
from shoal.proto.structured_params import StructuredOutputsParams
from shoal.proto.verdict_cache import VerdictCache

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The library's own budget for one grammar: the size of its productions, the
# fuel of building its lexer and of each mask step, its lexer states (memory).
# The router's check and the worker's compile both run under it, so a spec
# costs at most this much to check or compile, however it is built.
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2_000,
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis
    step_lexer_fuel=200_000,  # ~14 ms a mask step
    step_max_items=50_000,
    max_lexer_states=250_000,  # 1-2 kB each
    max_grammar_size=500_000,
)
# The router's verdict on each distinct spec (structured_params.SPEC_CHECKS checks the schema first).
GRAMMAR_CHECKS = VerdictCache()

# Compact JSON with the separators people write: a flexible-whitespace grammar
# lets a weak model emit newlines for ever (vLLM's long-standing whitespace loops).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked)."""
    try:
        return _grammar_text(params)
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidRequestError(f"{params.field}: {_short(e)}", field=params.field) from None


def _grammar_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(params.spec, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(cast(str, params.regex))
    if kind == "choice":
        return llguidance.grammar_from("choice", params.spec)
    return llguidance.grammar_from("grammar", cast(str, params.grammar))  # Lark, or GBNF converted to Lark


def validate(params: StructuredOutputsParams) -> None:
    """The spec's own check (params.validate()), then the library's without a
    tokenizer under LIMITS: the router's, before any worker sees the request.
    Raises InvalidRequestError naming the field. Once per object (a request's
    prompts and samples share it), and once per distinct spec in the process
    (GRAMMAR_CHECKS); run it off the event loop."""
    params.validate()
    if params.passed("grammar"):
        return
    reason = GRAMMAR_CHECKS.get(params.digest, lambda: problem(params))
    if reason is not None:
        raise InvalidRequestError(f"{params.field}: {reason}", field=params.field)
    params.mark("grammar")


def problem(params: StructuredOutputsParams) -> str | None:
    """Why the library refuses the spec (without the field's name), or None."""
    try:
        error = llguidance.LLMatcher.validate_grammar(_grammar_text(params), limits=LIMITS)
    except (ValueError, TypeError, RecursionError) as e:
        return _short(e)
    return f"{what(params)} is not supported: {_short(error)}" if error else None


def what(params: StructuredOutputsParams) -> str:
    return {
        "json": "the JSON schema",
        "json_object": "json_object",
        "regex": "the regex",
        "choice": "the choice",
        "grammar": "the grammar",
    }[params.kind]


def _short(error: object) -> str:
    text = str(error).strip()
    return text if len(text) <= 300 else text[:297] + "..."
