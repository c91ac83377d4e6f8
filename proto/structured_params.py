"""What a request constrains its output to (vLLM's StructuredOutputsParams):
one of a JSON schema, any JSON object, a regular expression, a choice of
strings, or a Lark/EBNF grammar. Plain data, no grammar library: the
router imports it, and the engine compiles it (workers/structured_output/)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import cast

from shoal.proto.errors import InvalidRequestError
from shoal.proto.json_pointer import PointerError, ref_cycle, schema_height
from shoal.proto.verdict_cache import VerdictCache

# A spec is compiled on every worker it reaches and sits in a cache: bounded like a prompt's text.
MAX_SPEC_CHARS = 256 * 1024
# Objects nested in a JSON schema, $refs followed (json_pointer.schema_height): a grammar library
# recurses that deep compiling it, and one crashed its process past ~2,500 (an 8 MiB stack).
MAX_SCHEMA_HEIGHT = 256
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_FIELDS = ("json", "json_object", "regex", "choice", "grammar", "field")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one field is set. `json` is the schema's JSON text (a dict
    given here is serialized as given: property order shapes the output);
    `field` is the request field it came from, which errors name
    (response_format, structured_outputs, tool_choice...).

    The constructor checks the shape (cheap; SamplingParams checks only
    that). validate() also checks the spec itself (a JSON schema's text and
    its $refs), where it is compiled, off any event loop (the router's spec
    check, a worker's grammar threads): once per distinct spec in a process
    (SPEC_CHECKS), and once per object after that."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"
    # The checks this object passed, each with the spec it checked (by
    # identity: a value set past the constructor is checked again); never pickled.
    _marks: tuple[tuple[str, object], ...] = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _digest: tuple[object, bytes] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )  # (spec, digest)

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            try:
                text = json.dumps(self.json, separators=(",", ":"))
            except (ValueError, TypeError, RecursionError) as e:
                raise InvalidRequestError(
                    f"{self.field}: the JSON schema cannot be serialized: {type(e).__name__}", field=_name(self.field)
                ) from None
            object.__setattr__(self, "json", text)
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.check_shape()

    # An unpickled spec (a worker's) is checked afresh: the check's mark stays behind.
    def __getstate__(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __setstate__(self, state: tuple[object, ...]) -> None:
        for name, value in zip(_FIELDS, state):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_marks", ())
        object.__setattr__(self, "_digest", None)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The spec as one string of its kind (the cache key, with the kind)."""
        kind = self.kind
        if kind == "json_object":
            return '{"type":"object"}'
        if kind == "choice":
            return json.dumps(list(cast("tuple[str, ...]", self.choice)))
        text: str = getattr(self, kind)
        return text

    @property
    def digest(self) -> bytes:
        """A short key for the spec (kind and text): what caches hold instead
        of the text. Hashed once per object (per request, not per sample)."""
        source = self._source
        if self._digest is None or self._digest[0] is not source:
            object.__setattr__(self, "_digest", (source, spec_digest(self.kind, self.spec)))
        return cast("tuple[object, bytes]", self._digest)[1]

    def validate(self) -> None:
        """The shape, then the spec itself (cached); whether the grammar
        library accepts it is the compiler's check."""
        self.check_shape()
        if self.json is not None and not self.passed("schema"):
            text = self.json
            reason = SPEC_CHECKS.get(self.digest, lambda: json_schema_problem(text))
            if reason is not None:
                raise InvalidRequestError(f"{self.field}: {reason}", field=self.field)
            self.mark("schema")

    def passed(self, check: str) -> bool:
        """Whether this object passed `check` (see mark) with the spec it holds now."""
        source = self._source
        return any(name == check and spec is source for name, spec in self._marks)

    def mark(self, check: str) -> None:
        """Note that this object passed `check` (a name): checked once per object, not per prompt or sample."""
        object.__setattr__(self, "_marks", (*self._marks, (check, self._source)))

    @property
    def _source(self) -> object:
        kind = self.kind
        return getattr(self, kind) if kind != "json_object" else kind

    def check_shape(self) -> None:
        """Types and sizes: no work that grows with the spec."""
        f = self.field
        if not isinstance(f, str):
            raise InvalidRequestError("structured output field name must be a string")
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"{f} must set exactly one of {', '.join(KINDS)}; got {', '.join(set_) or 'none'}", field=f
            )
        if type(self.json_object) is not bool:
            raise InvalidRequestError(f"{f}: json_object must be a boolean", field=f)
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                raise InvalidRequestError(f"{f}: {name} must be a non-empty string", field=f)
            if len(v) > MAX_SPEC_CHARS:
                raise InvalidRequestError(f"{f}: {name} has {len(v)} characters; at most {MAX_SPEC_CHARS}", field=f)
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, tuple) or not c or len(c) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"{f}: choice must be a non-empty array of at most {MAX_CHOICES} non-empty strings", field=f
                )
            if not all(isinstance(s, str) and s for s in c):
                raise InvalidRequestError(f"{f}: choice must be a non-empty array of non-empty strings", field=f)
            if sum(map(len, c)) > MAX_SPEC_CHARS:
                raise InvalidRequestError(
                    f"{f}: choice may hold at most {MAX_CHOICES} strings, {MAX_SPEC_CHARS} characters", field=f
                )


def _name(f: object) -> str | None:
    return f if isinstance(f, str) else None


def spec_digest(kind: str, spec: str) -> bytes:
    # surrogatepass: JSON may spell a lone surrogate ("\ud800"), which plain UTF-8 refuses
    return hashlib.blake2b(kind.encode() + b"\0" + spec.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def json_schema_problem(text: str) -> str | None:
    """What is wrong with a JSON schema's text, or None: not JSON (nested
    past the parser's depth included), not a schema, a malformed $ref
    pointer, a $ref cycle. Linear in the text."""
    try:
        schema = json.loads(text)
    except RecursionError:
        return "the JSON schema is nested too deeply"
    except ValueError as e:
        return f"the JSON schema is not valid JSON: {e}"
    if not isinstance(schema, (dict, bool)):
        return "a JSON schema must be an object or a boolean"
    try:
        cycle = ref_cycle(schema)
    except PointerError as e:
        return str(e)
    if cycle is not None:
        shown = cycle if len(cycle) <= 8 else [*cycle[:7], "...", cycle[-1]]
        return (
            f"the JSON schema has a $ref cycle ({' -> '.join(p[:80] for p in shown)}); a schema may recur only "
            "inside a property or an item"
        )
    if schema_height(schema, MAX_SCHEMA_HEIGHT) > MAX_SCHEMA_HEIGHT:
        return (
            f"the JSON schema nests objects, through its $refs, more than {MAX_SCHEMA_HEIGHT} deep (a chain of "
            "definitions each naming the next counts as nesting)"
        )
    return None


# Each distinct JSON schema's check, once per process (the router's threads and the engine share it).
SPEC_CHECKS = VerdictCache()
