"""Parallel sampling at the router: `n` choices of each prompt, and on
completions `best_of` samples of which the n likeliest are returned.

Each sample is an ordinary engine request (its own failover, abort, deltas
and trace span): the request's `width` samples per prompt (best_of, else n)
run as `rid-<c>` for choice c = prompt_index * width + k, as OpenAI orders
choices (`rid` alone when there is one sample in all). The samples of one
prompt carry their first one's id as GenerateRequest.parent_request_id: the
request router sends them to one worker, whose scheduler prefills the prompt
once and lets the others share its KV blocks. Sample k draws with seed + k
when the client gave a seed (as vLLM's parallel sampling), so choice k equals
that seed's run alone; without one, each draws its own. Greedy samples are
all the same choice.

best_of > n ranks the finished samples by the sum of their sampled tokens'
logprobs (vLLM v0's rule), so each sample asks the engine for them
(logprobs=0 when the client asked none; the response then shows none).
Usage counts each prompt once (its first sample's prompt and cached tokens)
and the completion tokens of every sample run, those not returned too: what
the request cost, as OpenAI bills best_of (vLLM counts the returned ones).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shoal.proto.sampling_params import SamplingParams
from shoal.router.fronts.frontend import ServingError
from shoal.router.fronts.openai_protocol import ParsedRequest

_SEED_END = 2**64  # SamplingParams' seeds lie in [-2**63, 2**64)


def width(parsed: ParsedRequest) -> int:
    """Engine requests per prompt."""
    return parsed.best_of or parsed.n


def check(parsed: ParsedRequest, max_n: int, chat: bool) -> None:
    """Refuse (400 naming the field) n or best_of past the engine's --max-n,
    and best_of on chat, which OpenAI's chat API does not have."""
    if chat and parsed.best_of not in (None, 1):
        raise ServingError("invalid", "best_of is only supported on /v1/completions", field="best_of")
    for name in ("n", "best_of"):
        value = getattr(parsed, name)
        if value is not None and value > max_n:
            raise ServingError("invalid", f"{name} must be at most {max_n} (--max-n), got {value}", field=name)


def request_ids(rid: str, count: int) -> list[str]:
    """The engine ids of `count` samples: `rid` for one, else `rid-0`, `rid-1`, ..."""
    return [rid] if count == 1 else [f"{rid}-{c}" for c in range(count)]


def sample_params(params: SamplingParams, k: int, ranked: bool) -> SamplingParams:
    """Sample k's parameters: seed + k (wrapped into the seed range), and
    each token's logprob when the samples are to be ranked."""
    changes: dict[str, Any] = {}
    if params.seed is not None and k:
        seed = params.seed + k
        changes["seed"] = seed - _SEED_END if seed >= _SEED_END else seed
    if ranked and params.logprobs is None:
        changes["logprobs"] = 0
    return dataclasses.replace(params, **changes) if changes else params


def expand(
    prepared: list[tuple[list[int], SamplingParams]], rids: list[str], parsed: ParsedRequest
) -> list[tuple[list[int], SamplingParams, str | None]]:
    """Each sample's (prompt ids, params, parent_request_id), in choice order;
    `prepared` holds each prompt's ids and params, `rids` request_ids'."""
    w = width(parsed)
    ranked = w > parsed.n
    out = []
    for p, (ids, params) in enumerate(prepared):
        parent = rids[p * w] if w > 1 else None
        out += [(ids, sample_params(params, k, ranked), parent) for k in range(w)]
    return out


def best(choices: list[dict], n: int, w: int) -> list[dict]:
    """The n samples of each prompt's w with the highest cumulative logprob
    (ties: the lower index), in that order, numbered as n choices a prompt.
    choices: the app's dicts ("index", "lps": TokenLogprob list, ...) in choice order."""
    if w == n:
        return choices
    out = []
    for p in range(0, len(choices), w):
        group = choices[p : p + w]
        ranked = sorted(range(w), key=lambda k: (-sum(lp.logprob for lp in group[k]["lps"]), k))
        out += [dict(group[k], index=p // w * n + j) for j, k in enumerate(ranked[:n])]
    return out
