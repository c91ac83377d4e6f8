"""The load generator `shoal bench serve` and its peers share: a request's
result, offering a workload at its arrival times through a `send`
function, and the sender for any OpenAI-compatible HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def offer(work, send, label: str) -> tuple[list[Result], float]:
    from tqdm import tqdm

    bar = tqdm(total=len(work), desc=label, leave=False)
    start = time.perf_counter()

    async def one(offset, prompt, max_tokens):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        r = Result()
        t0 = last = time.perf_counter()
        try:
            # (new tokens, prompt tokens once known, completion tokens once known)
            counted = None
            async for ntok, nprompt, ncompletion in send(prompt, max_tokens):
                r.prompt_tokens = nprompt or r.prompt_tokens
                counted = ncompletion or counted
                if not ntok:
                    continue
                now = time.perf_counter()
                if r.output_tokens == 0:
                    r.ttft = now - t0
                else:
                    r.itl.append(now - last)
                last = now
                r.output_tokens += ntok
            r.ok, r.e2e = True, time.perf_counter() - t0
            r.output_tokens = counted or r.output_tokens
        except Exception as e:
            r.error = f"{type(e).__name__}: {e}"[:200]
        bar.update(1)
        return r

    results = await asyncio.gather(*(one(*w) for w in work))
    bar.close()
    return results, time.perf_counter() - start


def http_sender(session, base_url: str, model: str | None, api_key: str | None):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(prompt, max_tokens):
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            body["model"] = model
        async with session.post(base_url.rstrip("/") + "/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    yield 1, 0, None  # SSE chunks count deltas; the usage chunk gives the tokens
                elif chunk.get("usage"):
                    yield 0, chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]

    return send


def salted(work, salt: str):
    """The same prompts with another first word, so that one target's prompts
    never hit the prefix cache another target filled."""
    if not salt:
        return work
    return [(t, salt + " " + p.split(" ", 1)[1], n) for t, p, n in work]
