"""JSON pointers as RFC 6901 reads them (in a URI fragment, section 6), and
the one structural check a JSON schema gets before a grammar library sees
it: no $ref cycle that recurs before reading anything. Linear in the
schema: each node is expanded once and each distinct $ref resolved once,
whatever the number of spellings pointing at one node."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

# RFC 6901: an array index is "0" or ASCII digits without a leading zero.
# ([0-9], not \d: \d matches every script's digits, '٠' and '۰' among them.)
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
_MAX_INDEX_DIGITS = 18  # past any list's length; int() refuses more than 4,300 digits
_BAD_ESCAPE = re.compile(r"~(?![01])")
_COMBINATORS = ("allOf", "anyOf", "oneOf")


class PointerError(ValueError):
    """A $ref that is no JSON pointer by RFC 6901 (the message says which and why)."""


@dataclass(slots=True)
class RefWalk:
    """The work one check did, counted: nodes expanded, edges followed,
    pointer tokens read. Tests bound it by the schema's size."""

    nodes: int = 0
    edges: int = 0
    tokens: int = 0

    @property
    def total(self) -> int:
        return self.nodes + self.edges + self.tokens


_MISSING = object()


def resolve(document: Any, ref: str, walk: RefWalk | None = None) -> Any:
    """The value the local reference `ref` ("#", "#/a/0/b~1c", percent-encoded
    or not) names in `document`; None when it names nothing there or is not
    a JSON pointer fragment (an anchor: the library's to resolve and report).
    Raises PointerError for a malformed pointer."""
    fragment = unquote(ref[1:], errors="replace") if "%" in ref else ref[1:]
    if not fragment:
        return document
    if not fragment.startswith("/"):
        return None
    if _BAD_ESCAPE.search(fragment):
        raise PointerError(f"$ref {_show(ref)} is not a JSON pointer: '~' must be followed by 0 or 1 (RFC 6901)")
    node = document
    for token in fragment[1:].split("/"):
        if walk is not None:
            walk.tokens += 1
        token = token.replace("~1", "/").replace("~0", "~")  # in this order (RFC 6901 section 4)
        if isinstance(node, dict):
            node = node.get(token, _MISSING)
            if node is _MISSING:
                return None
        elif isinstance(node, list):
            if token == "-":  # past the end: names nothing
                return None
            if not _ARRAY_INDEX.fullmatch(token):
                raise PointerError(
                    f"$ref {_show(ref)} is not a JSON pointer: array index {_show(token)} must be ASCII digits "
                    "without a leading zero (RFC 6901)"
                )
            if len(token) > _MAX_INDEX_DIGITS or int(token) >= len(node):
                return None
            node = node[int(token)]
        else:
            return None
    return node


def _show(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def ref_cycle(schema: Any, walk: RefWalk | None = None) -> list[str] | None:
    """A chain of local $refs that comes back to where it started with
    nothing in between but references and combinators (a -> b -> a): a
    grammar that recurs before it reads anything. Recursion through a
    property or an item is a tree, and fine. Every object in the document
    is a possible start. Returns the chain's $refs (the first repeated at
    the end), or None; raises PointerError for a malformed $ref."""
    walk = walk if walk is not None else RefWalk()
    targets: dict[str, object] = {}  # each distinct $ref resolved once

    def successors(node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(label, node) of what `node` stands for before it reads any input."""
        out = []
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref not in targets:
                targets[ref] = resolve(schema, ref, walk)
            target = targets[ref]
            if isinstance(target, dict):
                out.append((ref, target))
        for key in _COMBINATORS:
            subs = node.get(key)
            if isinstance(subs, list):
                out += [(key, sub) for sub in subs if isinstance(sub, dict)]
        return out

    state: dict[int, int] = {}  # id(node) -> 1: on the current path, 2: done (the document holds every node)
    for start in _objects(schema, walk):
        if id(start) in state:
            continue
        state[id(start)] = 1
        stack = [(start, iter(successors(start)))]
        on_path = {id(start): 0}  # id(node) -> its place in stack
        labels: list[str] = []  # labels[i]: the edge from stack[i] to stack[i + 1]
        while stack:
            for label, nxt in stack[-1][1]:
                walk.edges += 1
                seen = state.get(id(nxt))
                if seen == 1:
                    refs = [x for x in [*labels[on_path[id(nxt)] :], label] if x.startswith("#")]
                    return [*refs, refs[0]]
                if seen is None:
                    state[id(nxt)] = 1
                    on_path[id(nxt)] = len(stack)
                    labels.append(label)
                    stack.append((nxt, iter(successors(nxt))))
                    break
            else:
                node, _ = stack.pop()
                state[id(node)] = 2
                del on_path[id(node)]
                if labels:
                    labels.pop()
    return None


def _objects(document: Any, walk: RefWalk) -> Iterator[dict[str, Any]]:
    """Every object (dict) in the document, iteratively (any depth)."""
    todo = [document]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            walk.nodes += 1
            yield x
            todo += [v for v in x.values() if isinstance(v, (dict, list))]
        elif isinstance(x, list):
            walk.nodes += 1
            todo += [v for v in x if isinstance(v, (dict, list))]


def schema_height(schema: Any, limit: int, walk: RefWalk | None = None) -> int:
    """How deep a grammar library recurses to expand `schema`: the longest
    chain of nested objects, a local $ref counting as the object it names
    (a reference back to one already on the chain counts nothing: the
    library recurs lazily there). Returns as soon as it passes `limit`.
    Linear: each object's height is computed once, iteratively, whatever
    order the document lists its definitions in. (llguidance overflows its
    thread's stack, killing the process, on a chain of ~900 definitions.)"""
    walk = walk if walk is not None else RefWalk()
    targets: dict[str, Any] = {}
    on_chain = -1
    height: dict[int, int] = {}  # id(object) -> its height, or on_chain

    def children(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref not in targets:
                targets[ref] = resolve(schema, ref, walk)
            if isinstance(targets[ref], dict):
                yield targets[ref]
        lists = [v for v in node.values() if isinstance(v, list)]
        for v in node.values():
            if isinstance(v, dict):
                yield v
        while lists:  # objects inside arrays (anyOf, items, prefixItems), at any depth of arrays
            for v in lists.pop():
                if isinstance(v, dict):
                    yield v
                elif isinstance(v, list):
                    lists.append(v)

    best = 0
    for start in _objects(schema, walk):
        if id(start) in height:
            continue
        height[id(start)] = on_chain
        stack, tallest = [(start, children(start))], [0]
        while stack:
            node, todo = stack[-1]
            for child in todo:
                walk.edges += 1
                h = height.get(id(child))
                if h is None:
                    height[id(child)] = on_chain
                    stack.append((child, children(child)))
                    tallest.append(0)
                    if len(stack) > limit:
                        return len(stack)
                    break
                if h != on_chain:
                    tallest[-1] = max(tallest[-1], h)
            else:
                stack.pop()
                h = tallest.pop() + 1
                height[id(node)] = h
                best = max(best, h)
                if h > limit:
                    return h
                if tallest:
                    tallest[-1] = max(tallest[-1], h)
    return best
