"""The hostile mix of `shoal bench soak --hostile-fraction`: requests that
once froze a router or made one request worth a thousand, sent beside the
honest load so that what they cost the honest requests is measured.

Each payload is one of: a POST whose answer is read whole (the server should
answer 4xx or 200 quickly), a stream whose reader stops reading (the server
must bound what it buffers), and a connection that never finishes its
headers (the server must time it out)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

# How long a slow reader or a half-open connection is held before the client
# gives up on it itself (the server is expected to end it first).
HOLD_S = 30.0
UNICODE_ZEROS = "0٠۰߀०০੦૦୦௦౦೦൦๐໐༠၀႐០᠐"


@dataclass(slots=True)
class Hostile:
    kind: str
    action: str  # "post", "slow_reader", "half_open"
    path: str = "/completions"
    body: dict | None = None


def _ref_pointers(n: int) -> dict:
    """A schema whose properties name one node through n distinct pointers
    spelt with other scripts' zero digits (RFC 6901 allows ASCII digits only)."""
    props, k = {}, 0
    for width in range(1, 6):
        for z in UNICODE_ZEROS:
            if k >= n:
                break
            props[f"p{k}"] = {"$ref": "#/$defs/L/" + z * width}
            k += 1
    return {"type": "object", "properties": props, "$defs": {"L": [{"type": "string"}]}}


def _tools_body(rng: random.Random) -> dict:
    fn = {
        "name": "save",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    }
    return {
        "messages": [{"role": "user", "content": "Save a very long note " + str(rng.random())}],
        "tools": [{"type": "function", "function": fn}],
        "tool_choice": "required",
        "max_tokens": 256,
        "stream": True,
    }


def hostile_request(rng: random.Random, vocab_size: int = 49152) -> Hostile:
    """One hostile request, drawn at random from the mix."""
    kind = rng.choice(
        ("ref_unicode", "deep_json", "ref_superscript", "logit_bias", "fanout", "tools", "slow_reader", "half_open")
    )
    prompt = "Tell me a story about " + str(rng.random())
    if kind == "ref_unicode":
        return Hostile(
            kind, "post", body={"prompt": prompt, "max_tokens": 8, "structured_outputs": {"json": _ref_pointers(100)}}
        )
    if kind == "deep_json":
        return Hostile(
            kind, "post", body={"prompt": prompt, "max_tokens": 8, "structured_outputs": {"json": "[" * 100_000}}
        )
    if kind == "ref_superscript":
        schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/L/²"}}, "$defs": {"L": [{"type": "string"}]}}
        return Hostile(kind, "post", body={"prompt": prompt, "max_tokens": 8, "structured_outputs": {"json": schema}})
    if kind == "logit_bias":
        bias = {str(t): 1.0 for t in range(min(32_000, vocab_size))}
        return Hostile(kind, "post", body={"prompt": [prompt] * 64, "n": 16, "max_tokens": 8, "logit_bias": bias})
    if kind == "fanout":
        return Hostile(kind, "post", body={"prompt": [prompt] * 64, "n": 16, "max_tokens": 64, "seed": 1})
    if kind == "tools":
        return Hostile(kind, "post", "/chat/completions", _tools_body(rng))
    if kind == "slow_reader":
        return Hostile(kind, "slow_reader", body={"prompt": prompt, "max_tokens": 512, "stream": True})
    return Hostile(kind, "half_open")


async def send_hostile(session, base_url: str, h: Hostile, hold_s: float = HOLD_S) -> str:
    """Send one hostile request; what came back, as a count key."""
    if h.action == "half_open":
        return await _half_open(base_url, hold_s)
    async with session.post(base_url + h.path, json=h.body) as resp:
        if h.action == "slow_reader" and resp.status == 200:
            await resp.content.readline()
            try:  # read nothing more: the server's buffer for this stream fills
                await asyncio.wait_for(resp.content.wait_eof(), hold_s)
            except TimeoutError:
                pass
            resp.close()
            return f"{h.kind}: held"
        await resp.read()
        return f"{h.kind}: {resp.status}"


async def _half_open(base_url: str, hold_s: float) -> str:
    """A connection that sends half a request's headers and waits: 'closed'
    when the server hangs up first."""
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(f"POST {u.path}/completions HTTP/1.1\r\nHost: {u.hostname}\r\n".encode())
        await writer.drain()
        try:
            got = await asyncio.wait_for(reader.read(), hold_s)
        except TimeoutError:
            return "half_open: still open"
        return "half_open: closed" if not got else "half_open: answered"
    finally:
        writer.close()
