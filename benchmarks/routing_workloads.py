"""The routing benchmark's workloads and its ideal prefix cache: pure Python,
no Ray, no model (`shoal bench routing` in routing.py drives them).

A workload is a list of Requests in arrival order: Poisson arrivals, each a
prompt of token ids, a max_tokens and a sampling seed.

- `shared`: multi-turn chats over SYSTEM_PROMPTS long system prompts. A
  fixed number of chats (`open_chats`) are open at once; each arrival is
  the next turn of one of them, picked at random (a chat that has had its
  turns, or would outgrow max_context, is replaced by a new one). A turn's
  prompt is the previous turn's prompt, its reply and a new user message.
- `hot`: the same, but one system prompt starts `hot_share` of the chats.
- `unique`: single turns of random tokens: no prefix is ever shared.

The reply a turn carries forward is the one a simulated worker generates
(load_format simulated: token i of a seeded request is stand_in_token(seed,
i)), so on simulated workers a follow-up hits the cache through the previous
reply, as a real chat does; real workers reply with their own tokens, and a
follow-up hits through the previous prompt only. Output lengths are
lognormal (heavy-tailed), clipped to [1, output_max]; requests ignore eos.

The ideal hit rate replays the requests in arrival order through one
BlockManager as large as all the workers' caches together (each request's
prompt, then its reply, then freed): a shared cache that never waits.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shoal.proto.block_hash import chain_hashes
from shoal.proto.sampling_params import SamplingParams
from shoal.proto.utils import cdiv
from shoal.workers.core.block_manager import BlockManager
from shoal.workers.core.sequence import RequestTimings
from shoal.workers.core.sequence import Sequence as EngineSequence
from shoal.workers.model_executor.runner.simulated_runner import stand_in_token

WORKLOADS = ("shared", "unique", "hot")


@dataclass(frozen=True, slots=True)
class WorkloadSizes:
    """Sizes in tokens; the defaults are the simulated run's."""

    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1024, 2048)  # each system prompt's length, uniform
    user_tokens: tuple[int, int] = (32, 256)  # each user message's
    unique_tokens: tuple[int, int] = (256, 1024)  # `unique`: each prompt's
    output_median: float = 24.0  # lognormal output lengths: median, log-space sigma, cap
    output_sigma: float = 1.0
    output_max: int = 256
    mean_turns: float = 4.0  # a chat's turns, geometric, at most max_turns
    max_turns: int = 8
    open_chats: int = 32
    hot_share: float = 0.8  # `hot`: the share of chats on system prompt 0
    max_context: int = 3584  # a turn's prompt + max_tokens stays within this

    def scaled(self, factor: float) -> WorkloadSizes:
        """Every token length times `factor` (at least 1 token; chat counts unchanged)."""

        def s(x):
            return max(1, round(x * factor))

        return dataclasses.replace(
            self,
            system_tokens=(s(self.system_tokens[0]), s(self.system_tokens[1])),
            user_tokens=(s(self.user_tokens[0]), s(self.user_tokens[1])),
            unique_tokens=(s(self.unique_tokens[0]), s(self.unique_tokens[1])),
            output_median=max(1.0, self.output_median * factor),
            output_max=s(self.output_max),
            max_context=s(self.max_context),
        )


@dataclass(frozen=True, slots=True)
class Vocab:
    """What the prompts are drawn from and what a simulated reply avoids."""

    size: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def first(self) -> int:
        """Prompt ids start above the low ids, where tokenizers keep their special tokens."""
        return min(256, self.size // 4)


@dataclass(slots=True)
class Request:
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    seed: int
    group: int = -1  # its system prompt (-1: none)
    chat: int = -1
    turn: int = 0


@dataclass(slots=True)
class _Chat:
    chat: int
    group: int
    turns: int
    last: Request | None = None
    done: int = 0


def reply_tokens(req: Request, vocab: Vocab) -> list[int]:
    """The tokens a simulated worker generates for `req` (it never ends early)."""
    return [stand_in_token(req.seed, i, vocab.size, vocab.eos_token_ids) for i in range(req.max_tokens)]


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def output_length(sizes: WorkloadSizes, rng: random.Random) -> int:
    n = round(sizes.output_median * math.exp(sizes.output_sigma * rng.gauss(0.0, 1.0)))
    return max(1, min(sizes.output_max, n))


def _tokens(n: int, vocab: Vocab, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab.first, vocab.size) for _ in range(n)]


def make_workload(
    kind: str, rate: float, duration_s: float, seed: int, vocab: Vocab, sizes: WorkloadSizes = WorkloadSizes()
) -> list[Request]:
    """The requests arriving in [0, duration_s) at `rate` per second; the same
    (kind, rate, duration, seed, vocab, sizes) give the same list."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"{kind}/{seed}")
    arrivals = poisson_arrivals(rate, duration_s, rng)
    if kind == "unique":
        return [
            Request(
                t,
                _tokens(rng.randint(*sizes.unique_tokens), vocab, rng),
                output_length(sizes, rng),
                rng.getrandbits(62),
            )
            for t in arrivals
        ]
    systems = [_tokens(rng.randint(*sizes.system_tokens), vocab, rng) for _ in range(sizes.system_prompts)]
    slots: list[_Chat | None] = [None] * sizes.open_chats
    chats = 0
    out = []
    for t in arrivals:
        k = rng.randrange(len(slots))
        for _ in range(2):  # the open chat's next turn, or (when it is over) a new chat's first
            c = slots[k]
            if c is None or c.done >= c.turns:
                c = slots[k] = _new_chat(kind, chats, sizes, rng)
                chats += 1
            user = _tokens(rng.randint(*sizes.user_tokens), vocab, rng)
            n = output_length(sizes, rng)
            head = systems[c.group] if c.last is None else c.last.prompt + reply_tokens(c.last, vocab)
            if len(head) + len(user) + n <= sizes.max_context or c.last is None:
                break
            c.done = c.turns  # it would outgrow the context: this chat is over
        req = Request(
            t,
            head + user,
            min(n, max(1, sizes.max_context - len(head) - len(user))),
            rng.getrandbits(62),
            c.group,
            c.chat,
            c.done,
        )
        c.last, c.done = req, c.done + 1
        out.append(req)
    return out


def _new_chat(kind: str, chat: int, sizes: WorkloadSizes, rng: random.Random) -> _Chat:
    if kind == "hot" and rng.random() < sizes.hot_share:
        group = 0
    elif kind == "hot":
        group = rng.randrange(1, sizes.system_prompts) if sizes.system_prompts > 1 else 0
    else:
        group = rng.randrange(sizes.system_prompts)
    # Geometric turns with the given mean: P(another turn) = 1 - 1 / mean.
    turns = 1
    while turns < sizes.max_turns and rng.random() > 1.0 / sizes.mean_turns:
        turns += 1
    return _Chat(chat, group, turns)


# ---- footprints and the ideal cache --------------------------------------------


def _cached_tokens(req: Request, vocab: Vocab, replies_known: bool, index: int) -> list[int]:
    """What a worker's cache holds once `req` is done: its prompt and all of
    its reply but the last token (whose keys are never computed). A reply
    the next turn does not repeat (real workers) is tokens nothing matches."""
    reply = reply_tokens(req, vocab) if replies_known else [-1 - index] * req.max_tokens
    return req.prompt + reply[:-1]


def worker_blocks(
    sizes: WorkloadSizes, vocab: Vocab, block_size: int, cache_factor: float, seed: int = 0, replies_known: bool = True
) -> tuple[int, float]:
    """(a worker's KV blocks, `shared`'s working set in blocks): the cache
    holds 1/cache_factor of the working set (measured per arrival, so the
    same at any rate), and at least one longest request."""
    ws = working_set_blocks(
        make_workload("shared", 1.0, REFERENCE_S, seed, vocab, sizes), vocab, block_size, replies_known
    )
    longest = cdiv(sizes.max_context, block_size) + 1
    return max(longest, int(ws // cache_factor)), ws


# Seconds of arrivals at 1/s that `worker_blocks` measures the working set over.
REFERENCE_S = 600.0


def working_set_blocks(requests: Sequence[Request], vocab: Vocab, block_size: int, replies_known: bool = True) -> float:
    """The prefixes in play: the mean, over the arrivals, of how many distinct
    blocks have been used before and will be used again (what a cache must
    hold for every reuse to hit; Belady's working set)."""
    last_use: dict[int, int] = {}
    first_use: dict[int, int] = {}
    for i, r in enumerate(requests):
        for h in chain_hashes(_cached_tokens(r, vocab, replies_known, i), block_size):
            first_use.setdefault(h, i)
            last_use[h] = i
    # +1 at the first use, -1 at the last: live in between (only blocks used twice or more count).
    delta = [0] * (len(requests) + 1)
    for h, i in first_use.items():
        j = last_use[h]
        if j > i:
            delta[i] += 1
            delta[j] -= 1
    live, total = 0, 0
    for i in range(len(requests)):
        live += delta[i]
        total += live
    return total / len(requests) if requests else 0.0


@dataclass(slots=True)
class ReplayResult:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    per_request: list[int] = field(default_factory=list)  # hit tokens of each request

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


_PARAMS = SamplingParams(max_tokens=1)


def replay(
    requests: Sequence[Request],
    num_blocks: int,
    block_size: int,
    vocab: Vocab,
    replies_known: bool = True,
    assign: Iterable[int] | None = None,
    num_caches: int = 1,
) -> ReplayResult:
    """Each request in turn through `num_caches` BlockManagers of `num_blocks`
    (the one that `assign` names, else the first), as an engine with the
    prefix cache would take it: look up its prompt's cached blocks, compute
    the rest and its reply, free it. Returns the prompt tokens that hit."""
    bms = [BlockManager(num_blocks, block_size, enable_prefix_caching=True) for _ in range(num_caches)]
    which = iter(assign) if assign is not None else None
    out = ReplayResult()
    for i, r in enumerate(requests):
        bm = bms[next(which)] if which is not None else bms[0]
        tokens = _cached_tokens(r, vocab, replies_known, i)
        seq = EngineSequence(str(i), list(r.prompt), len(r.prompt), _PARAMS, i, 0, RequestTimings(0.0))
        hits = bm.get_computed_blocks(seq)
        if not bm.allocate_slots(seq, len(r.prompt) - len(hits) * block_size, hits):
            raise ValueError(f"request {i} ({len(tokens)} tokens) does not fit a cache of {num_blocks} blocks")
        seq.num_computed_tokens = len(r.prompt)
        if len(tokens) > len(r.prompt):
            seq.token_ids.extend(tokens[len(r.prompt) :])
            if not bm.allocate_slots(seq, len(tokens) - len(r.prompt)):
                raise ValueError(f"request {i} ({len(tokens)} tokens) does not fit a cache of {num_blocks} blocks")
            seq.num_computed_tokens = len(tokens)  # written, as a real step would (free keeps only those)
        bm.free(seq)
        hit = len(hits) * block_size
        out.hit_tokens += hit
        out.prompt_tokens += len(r.prompt)
        out.per_request.append(hit)
    return out


def ideal_hit_rate(
    requests: Sequence[Request],
    total_blocks: int,
    block_size: int,
    vocab: Vocab,
    replies_known: bool = True,
    counted: Iterable[int] | None = None,
) -> float:
    """The hit rate of one cache of `total_blocks` (all the workers' together)
    over the requests `counted` (indices; default all), replaying all of them."""
    res = replay(requests, total_blocks, block_size, vocab, replies_known)
    idx = range(len(requests)) if counted is None else list(counted)
    prompt = sum(len(requests[i].prompt) for i in idx)
    return sum(res.per_request[i] for i in idx) / prompt if prompt else 0.0
