"""`kv` (the default): ranks by an estimate of the time to this request's
first token, in prompt tokens of prefill (lower wins):

    cost = PREFILL_WEIGHT * (prompt - hit * block_size    # its own prefill: what the cache there cannot skip,
                             - tier * block_size * (1 - tier_ratio)         # less what its KV tiers give back,
                             - cluster * block_size * (1 - cluster_ratio))  # and the cluster tier
         + waiting_tokens + sent_tokens                    # the prefill queued ahead of it there
         + REQUEST_TOKENS * (waiting + sent)               # and each queued request's own steps
         + RUNNING_TOKENS * running                        # decodes share every step with it
         + MEM_TOKENS * used_after                         # 0 (empty) .. 1 (full) after this request
         + lora_cost                                       # getting its adapter into a slot there (lora.py)

after a first key: replicas where the request fits (free_after >= 0) come
before those where it does not, where

    free_after = free - sent_blocks - (need - hit)
    need       = ceil((prompt + min(max_tokens, EXPECTED_OUTPUT_TOKENS)) / block_size)

`hit` is how many of the prompt's leading blocks the replica holds (the
chain hashes it reported, plus those this process sent it since); `tier`,
how many more its host and disk tiers hold (reported), which it fetches
instead of prefilling; `cluster`, how many more than that the cluster tier
holds, taken to be the longest prefix any replica holds on device or in its
tiers (every block computed is published there). Each ratio is what a block
fetched costs against one prefilled, as the replica measured them
(replica_stats.tier_ratios): a hit on the device beats one in the host tier,
which beats one in the cluster, which beats a miss, by what each saves.

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

from shoal.router.routing.policies.base import DOES_NOT_FIT, Ranking
from shoal.router.routing.policies.least_requests import least_requests_rank
from shoal.router.routing.policies.lora import lora_cost
from shoal.router.routing.policies.need import RequestNeed, need_of
from shoal.router.routing.replica_stats import ReplicaFigures

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


class KVPolicy:
    name = "kv"
    summary = "free KV blocks, prefix-cache affinity and queue depth"
    needs_load = True
    needs_prefix = True
    needs_adapters = True
    serve_builtin = False

    def choose(self, request, figs: Sequence[ReplicaFigures], block_size: int, turn: int = 0) -> Ranking:
        if request is None or not block_size:  # (no size: no WorkerInfo read in this process yet)
            return Ranking(least_requests_rank(figs))
        ranked = kv_rank(figs, need_of(request, block_size))
        return Ranking([r[0] for r in ranked], *(ranked[0][1:] if ranked else (0, 0)))


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
    keys, hits, reached = [], [], []
    for f in figs:
        sent = f.sent
        cost = base + f.waiting_tokens + f.sent_tokens + per_request * (f.waiting + len(sent)) + per_running * f.running
        hit = 0
        # need.prefix_hit's binary search, inlined: the call costs ~20 us a request at 32 replicas
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
        local = hit
        if (off := f.offloaded) and hit < usable:  # its tiers go on from where its device stops
            while local < usable and hashes[local] in off:
                local += 1
            cost -= (local - hit) * saved * (1.0 - f.tier_ratio)
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
        reached.append(local)
    if figs and max(f.cluster_ratio for f in figs) >= 0:  # a cluster tier: any holder's blocks are everyone's
        reach = max(reached)
        for i, f in enumerate(figs):
            if f.cluster_ratio >= 0 and reach > reached[i]:
                keys[i] -= (reach - reached[i]) * saved * (1.0 - f.cluster_ratio)
                reached[i] = reach
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: ties keep the lower index
    return [(i, blocks - hits[i], prompt - reached[i] * bs) for i in order]


POLICY = KVPolicy()  # found by registry.py
