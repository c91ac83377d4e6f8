"""How the router ranks worker replicas: small pure functions over
ReplicaFigures (replica_stats.py), the same for Ray Serve's request router
(request_router.py) and the in-process pool (worker_pool.py).

`kv` ranks by an estimate of the time to this request's first token, in
prompt tokens of prefill (lower wins):

    cost = PREFILL_WEIGHT * (prompt - hit * block_size)   # its own prefill: what the cache there cannot skip
         + waiting_tokens + sent_tokens                    # the prefill queued ahead of it there
         + REQUEST_TOKENS * (waiting + sent)               # and each queued request's own steps
         + RUNNING_TOKENS * running                        # decodes share every step with it
         + MEM_TOKENS * used_after                         # 0 (empty) .. 1 (full) after this request

after a first key: replicas where the request fits (free_after >= 0) come
before those where it does not, where

    free_after = free - sent_blocks - (need - hit)
    need       = ceil((prompt + min(max_tokens, EXPECTED_OUTPUT_TOKENS)) / block_size)

`hit` is how many of the prompt's leading blocks the replica holds (the
chain hashes it reported, plus those this process sent it since).
A request under a LoRA adapter adds what getting the adapter into a slot
costs there, like a prefix miss: nothing where it sits in a device slot (or
this process just sent it a request under it), LORA_HOST_TOKENS where it is
in host memory, LORA_DISK_TOKENS where only its files are registered (both
plus LORA_HELD_TOKENS for each other adapter held there, in a slot or in
host memory, which the new one may push out: an adapter new to every
replica goes to the one holding the fewest, so adapters spread), and
DOES_NOT_FIT where the replica does not serve it at all (an adapter loaded
at run time after the replica started, or one whose files the replica
could not load: LORA_UNAVAILABLE, whatever this process sent it since):
such a replica comes last under
`kv`, `least-requests` and `round-robin`, which are otherwise blind to where
adapters are. `pow2` is Serve's own router and blind to adapters altogether:
there a replica that lacks a runtime-loaded adapter answers 404.

`waiting_tokens` is what the replica reported still to prefill (its waiting
requests' prompts less the prefix each found cached, and the rest of
chunked prompts in progress); `sent`, `sent_tokens` and `sent_blocks` are
what this process sent it that no report reflects yet. Weighing the queue by
its tokens, not its length, keeps a prefix holder attractive while what
waits there is mostly cache hits, and sends work away from one that is
prefilling long misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.observability import tracing
from shoal.router.routing.replica_stats import ReplicaFigures, ReplicaStats
from shoal.workers.lora.modules import LORA_IN_HOST, LORA_ON_DEVICE, LORA_ON_DISK, LORA_UNAVAILABLE
from shoal.workers.utils import cdiv

# The output a request is expected to need room for: max_tokens is only a
# bound (an OpenAI chat request without one gets the rest of the context),
# and the engine takes decode blocks as it goes, not up front; a few hundred
# tokens is a typical answer.
EXPECTED_OUTPUT_TOKENS = 256
# A request's own prefill counts twice: once for its own wait, once for
# the requests queued behind it there, whom recomputing a prefix another
# replica holds also delays. So a burst sharing a prefix stays on its holder
# while what queues there is mostly cache hits.
PREFILL_WEIGHT = 2.0
# A queued request costs its prefill tokens and, beyond them, the fixed
# part of the steps it takes (a step's overhead is some tens of tokens).
REQUEST_TOKENS = 64.0
# A running request adds its decode to every step this one waits through.
RUNNING_TOKENS = 128.0
# Memory pressure breaks ties between equally loaded replicas (the emptier
# wins), small beside a hit or a queued request: a full replica preempts.
MEM_TOKENS = 256.0
# LoRA: copying an adapter from host memory into a slot (and perhaps waiting
# for a slot to free), and reading it from disk first, in prompt tokens of
# prefill: a request goes to the replica that holds its adapter unless that
# one is busier by a few queued requests.
LORA_HOST_TOKENS = 256.0
LORA_DISK_TOKENS = 1024.0
LORA_HELD_TOKENS = 128.0
# Added to the cost where the request does not fit: past any cost a
# replica that fits can have, so those always come first.
DOES_NOT_FIT = 1e12


@dataclass(slots=True)
class RequestNeed:
    """One request, as the scoring sees it."""

    hashes: Sequence[bytes]  # the chain keys (block_hash.py) of the prompt's full blocks
    usable: int  # leading blocks a hit may cover: the engine always computes the last prompt token
    prompt_tokens: int
    blocks: int  # prompt + expected output
    block_size: int
    lora: str | None = None  # its LoRA adapter's name


def request_need(
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    hashes: Sequence[bytes] | None,
    lora: str | None = None,
) -> RequestNeed:
    expected = num_prompt_tokens + min(max_tokens, EXPECTED_OUTPUT_TOKENS)
    return RequestNeed(
        hashes or (),
        max(0, (num_prompt_tokens - 1) // block_size),
        num_prompt_tokens,
        cdiv(expected, block_size),
        block_size,
        lora,
    )


def need_of(request, block_size: int) -> RequestNeed:
    """A GenerateRequest's need, in blocks of the model's `block_size` (WorkerInfo's)."""
    return request_need(
        len(request.prompt_token_ids),
        request.params.max_tokens,
        block_size,
        request.block_hashes,
        getattr(request, "lora_name", None),
    )


def lora_cost(f: ReplicaFigures, lora: str) -> float:
    """What getting adapter `lora` into a slot costs at replica f (module docstring)."""
    held = f.loras.get(lora)
    if held is not None and held[1] == LORA_UNAVAILABLE:
        return DOES_NOT_FIT
    if lora in f.lora_sent:
        return 0.0
    if held is None and f.total_blocks:
        return DOES_NOT_FIT
    where = LORA_ON_DISK if held is None else held[1]  # (unreported: taken to serve it)
    if where == LORA_ON_DEVICE:
        return 0.0
    held = f.lora_sent.keys() | {n for n, (_, w) in f.loras.items() if w > LORA_ON_DISK}
    others = len(held) - (lora in held)
    return (LORA_HOST_TOKENS if where == LORA_IN_HOST else LORA_DISK_TOKENS) + LORA_HELD_TOKENS * others


def serving_first(order: list[int], figs: Sequence[ReplicaFigures], lora: str) -> list[int]:
    """`order` with the replicas that do not serve adapter `lora` moved last."""
    lacks = {i for i in order if lora_cost(figs[i], lora) >= DOES_NOT_FIT}
    return [i for i in order if i not in lacks] + [i for i in order if i in lacks]


def choose(
    policy: str, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0
) -> tuple[list[int], int, int]:
    """The replicas' order for `request` (a GenerateRequest, or None) under
    `policy`, best first, and what it takes at the first: KV blocks, and
    prompt tokens to prefill (0 and 0 for the policies that do not look)."""
    if policy == "kv":
        if request is None or not block_size:  # (no size: no WorkerInfo read in this process yet)
            return least_requests_rank(figs), 0, 0
        ranked = kv_rank(figs, need_of(request, block_size))
        return [r[0] for r in ranked], *(ranked[0][1:] if ranked else (0, 0))
    order = least_requests_rank(figs) if policy == "least-requests" else round_robin_rank(len(figs), turn)
    if (lora := getattr(request, "lora_name", None)) is not None:
        order = serving_first(order, figs, lora)
    return order, 0, 0


def route(
    stats: ReplicaStats, policy: str, request, names: Sequence[str], figs: Sequence[ReplicaFigures], turn: int = 0
) -> list[int]:
    """Choose, reserve, trace: the one routing step of both pools (Serve's
    request router and the in-process pool). The replicas' order for
    `request` (None for a call that is no request) over `figs` (those of
    `names`, from `stats`); the request counts as sent to the first.
    Parallel-sampling siblings (one parent_request_id) all go where the
    first of them went, whatever the policy: there the prompt is prefilled
    once for all of them."""
    order, blocks, tokens = choose(policy, request, figs, stats.block_size, turn)
    group = None if request is None else request.parent_request_id
    if group is not None and order and (at := stats.group_replica(group)) in names:
        pinned = names.index(at)
        if pinned != order[0]:
            order = [pinned, *(i for i in order if i != pinned)]
            blocks, tokens = (0, 0)
            if policy == "kv" and stats.block_size:
                blocks, tokens = blocks_at(request, figs[pinned], stats.block_size)
    if request is not None and order:
        stats.reserve(
            request.request_id,
            names[order[0]],
            blocks,
            request.block_hashes or (),
            tokens=tokens,
            group=group,
            lora=request.lora_name,
        )
        if request.trace_context:  # the request's routing span: what each candidate looked like
            tracing.trace_route(request.trace_context, list(names), figs, order[0], policy)
    return order


def blocks_at(request, f: ReplicaFigures, block_size: int) -> tuple[int, int]:
    """What `request` takes at replica f: KV blocks (its need less what f
    holds) and prompt tokens to prefill."""
    need = need_of(request, block_size)
    hit = prefix_hit(need.hashes, f.held, need.usable)
    return need.blocks - hit, need.prompt_tokens - hit * need.block_size


def prefix_hit(hashes: Sequence[bytes], held, limit: int | None = None) -> int:
    """How many leading hashes (at most `limit`) `held` contains, in
    O(log n) lookups: a binary search for the first one missing.

    It equals a linear scan when what is held is prefix-closed along the
    chain (block i held => blocks 0..i-1 held). A cache nearly always is: a
    block's hash chains its parent's, a sequence holds all its blocks, and
    a freed sequence is evicted tail first. Where it is not (a bounded report
    cut a chain, a parent evicted under another copy) the search returns
    some boundary i with block i-1 held and block i not: a fair estimate.
    """
    n = len(hashes) if limit is None else min(limit, len(hashes))
    if n == 0 or hashes[0] not in held:
        return 0
    if hashes[n - 1] in held:
        return n
    lo, hi = 1, n - 1  # hashes[lo - 1] is held, hashes[hi] is not: the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def kv_rank(figs: Sequence[ReplicaFigures], need: RequestNeed) -> list[tuple[int, int, int]]:
    """(index into figs, the blocks and the prefill tokens the request would
    take there), best first. Ties go to the lower index. Written for speed
    (it runs once per request over every replica): the module docstring's
    formula, unrolled, the fits-first key folded into one float."""
    hashes, usable, bs, blocks, prompt = need.hashes, need.usable, need.block_size, need.blocks, need.prompt_tokens
    lora = need.lora
    usable = min(usable, len(hashes))
    h0 = hashes[0] if usable else None
    last = usable - 1
    base = PREFILL_WEIGHT * prompt + MEM_TOKENS
    per_request, per_running, mem, saved = REQUEST_TOKENS, RUNNING_TOKENS, MEM_TOKENS, PREFILL_WEIGHT * bs
    keys, hits = [], []
    for f in figs:
        sent = f.sent
        cost = base + f.waiting_tokens + f.sent_tokens + per_request * (f.waiting + len(sent)) + per_running * f.running
        hit = 0
        # prefix_hit's binary search, inlined: the call costs ~20 us a request at 32 replicas
        # (94 against 72 us for choose_replicas here), and the goal is 100; a test holds the two equal.
        if h0 is not None and h0 in (held := f.held):
            if hashes[last] in held:
                hit = usable
            else:
                lo, hi = 1, last
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    if hashes[mid - 1] in held:
                        lo = mid
                    else:
                        hi = mid - 1
                hit = lo
            cost -= hit * saved
        total = f.total_blocks
        if total:  # reported; an unreported replica is taken to be empty
            free_after = f.free_blocks - f.sent_blocks - blocks + hit
            cost -= mem * free_after / total
            if free_after < 0:
                cost += DOES_NOT_FIT
        else:
            cost -= mem
        if lora is not None:
            cost += lora_cost(f, lora)
        keys.append(cost)
        hits.append(hit)
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: ties keep the lower index
    return [(i, blocks - hits[i], prompt - hits[i] * bs) for i in order]


def queue_depth(f: ReplicaFigures) -> int:
    """Requests at a replica: what it reported and what this process sent
    since, or this process's own count in flight there if that is more (a
    report older than this process's latest sends)."""
    return max(f.in_flight, f.running + f.waiting + len(f.sent))


def least_requests_rank(figs: Sequence[ReplicaFigures]) -> list[int]:
    return sorted(range(len(figs)), key=lambda i: (queue_depth(figs[i]), i))


def round_robin_rank(n: int, turn: int) -> list[int]:
    """Replica `turn % n` first, then the ones after it (fallbacks)."""
    start = turn % n if n else 0
    return [*range(start, n), *range(start)]
