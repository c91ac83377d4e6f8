"""What a request constrains its output to (vLLM's StructuredOutputsParams):
one of a JSON schema, any JSON object, a regular expression, a choice of
strings, or a Lark/EBNF grammar. Plain data, no grammar library: the
router imports it, and the engine compiles it (workers/structured_output/)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from shoal.workers.errors import InvalidRequestError

# A spec is compiled on every worker it reaches and sits in a cache: bounded like a prompt's text.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one field is set. `json` is the schema's JSON text (a dict
    given here is serialized, keys sorted, so equal schemas share one
    compiled grammar); `field` is the request field it came from, which
    errors name (response_format, structured_outputs, tool_choice...)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

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
            return json.dumps(list(self.choice))
        return getattr(self, kind)

    def validate(self) -> None:
        """The shape only; whether the library accepts it is the compiler's check."""
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
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"{f}: the JSON schema is not valid JSON: {e}", field=f) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(f"{f}: a JSON schema must be an object or a boolean", field=f)
            if (cycle := ref_cycle(schema)) is not None:
                raise InvalidRequestError(
                    f"{f}: the JSON schema has a $ref cycle ({' -> '.join(cycle)}); a schema may recur only "
                    "inside a property or an item",
                    field=f,
                )
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, tuple) or not c or not all(isinstance(s, str) and s for s in c):
                raise InvalidRequestError(f"{f}: choice must be a non-empty array of non-empty strings", field=f)
            if len(c) > MAX_CHOICES or sum(map(len, c)) > MAX_SPEC_CHARS:
                raise InvalidRequestError(
                    f"{f}: choice may hold at most {MAX_CHOICES} strings, {MAX_SPEC_CHARS} characters", field=f
                )


_COMBINATORS = ("allOf", "anyOf", "oneOf")


def ref_cycle(schema) -> list[str] | None:
    """A chain of local $refs that comes back to where it started with
    nothing in between but references and combinators (a -> b -> a): a
    grammar that recurs before it reads anything. Recursion through a
    property or an item is a tree, and fine. Returns the chain, or None."""

    def resolve(pointer: str):
        node = schema
        for part in pointer[2:].split("/") if pointer not in ("#", "#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None  # a missing target is the library's error to report
        return node

    def heads(node, out: list[str], depth: int = 0) -> list[str]:
        """The refs node stands for before it takes any input."""
        if not isinstance(node, dict) or depth > 32:
            return out
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out.append(ref)
        for key in _COMBINATORS:
            for sub in node.get(key) or [] if isinstance(node.get(key), list) else []:
                heads(sub, out, depth + 1)
        return out

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(pointer: str) -> list[str] | None:
        if state.get(pointer) == 1:
            return path[path.index(pointer) :] + [pointer]
        if state.get(pointer) == 2 or len(state) > 10_000:
            return None
        state[pointer] = 1
        path.append(pointer)
        for nxt in heads(resolve(pointer), []):
            if (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[pointer] = 2
        return None

    return visit("#")
