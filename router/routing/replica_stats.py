"""What this process knows of each worker replica, for the request router.

One registry per process, `replica_stats.REGISTRY` (always read through the
module: Serve pickles the request router's module by value, and a name
imported from here would be pickled as a copy), keyed by the replica's
unique id (the Worker's `name`, Serve's `replica_id.unique_id`). Two feeds:

- every GenerateDelta's `load` (the worker's figures after the step that made
  the delta), which ServeWorkerPool.generate hands over: the fresh path under
  load, as old as one engine step plus the hop back;
- the Worker's `record_routing_stats` (Serve's poll, a few times a second):
  the same WorkerLoad (as a dict) plus the cached chain hashes, most recently
  used first, and those its host and disk KV tiers hold (`offloaded`); the
  path when idle, and the only one for the hashes and the tiers' costs.

The block size is the model's, the same at every replica: the pools set it
once from WorkerInfo (`block_size`), never from a load report.

On top, optimistic accounting: what this process sent a replica that no
report reflects yet. A send counts until its stream's first message comes
back (the worker has taken it in: the load on that message counts it), or
until a report taken GRACE_S after it arrives (by then it sits in the
report's waiting or running), whichever is first. Its prompt's hashes count
as held there from the moment it is sent (SGLang's router assumes the same
of its approximate tree), until a poll taken GRACE_S later says otherwise.

Bounded: a request's entries go when its stream ends (done), even when Serve
routes it only after its client went away (the id is remembered, briefly);
a replica's go when it leaves, and whoever keeps figures per worker (the
router's metrics) hears of it through on_departure.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from shoal.proto.messages import WorkerLoad

# A send is reflected in a report taken this long after it: the hop to the
# worker plus the engine step it waits for (steps are ~10-50 ms on a GPU).
GRACE_S = 0.1
# Hashes held per replica: a poll's (up to the worker's export, 1024) plus
# those assumed since; past it the least recent go.
MAX_HELD = 8192
# What a block fetched from a KV tier is taken to cost, as a share of prefilling
# it, until the replica has measured both (a host tier's fetch is ~1-10%).
DEFAULT_FETCH_RATIO = 0.1
# Request ids whose stream ended before any reservation (a client gone while
# Serve was still routing), and replicas that left: remembered this many deep.
MAX_REMEMBERED = 4096


@dataclass(slots=True)
class ReplicaFigures:
    """One replica's last report, and what this process sent it since."""

    free_blocks: int = 0
    total_blocks: int = 0  # 0: no report yet
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0  # prompt tokens it had still to prefill
    reported_at: float = 0.0  # wall time the figures were taken (0: never)
    poll_time: float = 0.0  # `time` of the last poll result taken in
    # chain key (block_hash.py) -> 0.0 (reported by the replica) or when this
    # process sent it (assumed); insertion order is least recent first.
    held: dict[bytes, float] = field(default_factory=dict)
    # request id -> (blocks, prefill tokens, when), oldest first
    sent: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    sent_blocks: int = 0
    sent_tokens: int = 0
    in_flight: int = 0  # this process's streams to it, from send to end
    # LoRA: each adapter it serves by name -> (lora_int_id, where: proto/lora/modules.py's
    # LORA_ON_DEVICE / LORA_IN_HOST / LORA_ON_DISK), as reported; adapter name ->
    # when this process sent it a request under it (taken as on the device until
    # a report GRACE_S later says where it is).
    loras: dict[str, tuple[int, int]] = field(default_factory=dict)
    lora_sent: dict[str, float] = field(default_factory=dict)
    # KV tiers (workers/kv_transfer/): the chain keys its host and disk tiers hold, as
    # reported, and what fetching a block from them, or from the cluster tier, costs
    # against prefilling it (0: free, 1: no gain); cluster_ratio < 0: no cluster tier.
    offloaded: frozenset[bytes] = frozenset()
    tier_ratio: float = DEFAULT_FETCH_RATIO
    cluster_ratio: float = -1.0


class ReplicaStats:
    """The registry; safe to feed from one thread while another ranks (Serve
    may run its router on its own event-loop thread)."""

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s = grace_s
        self.replicas: dict[str, ReplicaFigures] = {}
        self.block_size = 0  # the model's (WorkerInfo.block_size), set by the pool; 0: not known yet
        self._where: dict[str, str] = {}  # request id -> replica, while in flight
        # Parallel sampling: a group's siblings go where its first one went (policies.route).
        self._groups: dict[str, list] = {}  # parent request id -> [replica, members in flight]
        self._group_of: dict[str, str] = {}  # request id -> its parent request id, while in flight
        self.version = 0  # changes when a replica's figures are made or dropped
        self._lock = threading.Lock()
        self._ended: OrderedDict[str, None] = OrderedDict()  # ids done before they were reserved
        self._departed: OrderedDict[str, None] = OrderedDict()  # replicas dropped, latest last
        self._on_departure: list[weakref.WeakMethod] = []

    def get(self, replica: str) -> ReplicaFigures:
        f = self.replicas.get(replica)
        if f is None:
            f = self.replicas.setdefault(replica, ReplicaFigures())
            self.version += 1
        return f

    # ---- reports ----------------------------------------------------------------

    def observe_load(
        self,
        replica: str,
        free_blocks: int,
        total_blocks: int,
        running: int,
        waiting: int,
        taken_at: float | None = None,
        waiting_tokens: int = 0,
        loras: dict | None = None,
    ) -> None:
        """A replica's figures (a delta's `load`, or a poll's)."""
        taken_at = time.time() if taken_at is None else taken_at
        f = self.get(replica)
        with self._lock:
            if taken_at < f.reported_at:  # an older report than the one held (a poll that lagged)
                return
            f.free_blocks, f.total_blocks = free_blocks, total_blocks
            f.running, f.waiting, f.waiting_tokens = running, waiting, waiting_tokens
            f.reported_at = taken_at
            self._supersede(f, taken_at - self.grace_s)
            if loras is not None:
                f.loras = {name: tuple(v) for name, v in loras.items()}
                cutoff = taken_at - self.grace_s
                if f.lora_sent:
                    f.lora_sent = {name: at for name, at in f.lora_sent.items() if at > cutoff}

    def observe_worker_load(self, load: WorkerLoad, taken_at: float | None = None) -> None:
        """A WorkerLoad: a GenerateDelta's, taken as of now (its hop back is
        part of what GRACE_S allows for), or a poll's, as of `taken_at`. A late
        delta of a replica that left does not bring its figures back."""
        if self.departed(load.worker):
            return
        self.observe_load(
            load.worker,
            load.num_free_blocks,
            load.num_total_blocks,
            load.num_running,
            load.num_waiting,
            taken_at,
            load.num_waiting_tokens,
            load.loras,
        )

    def observe_poll(self, replica: str, stats: dict) -> None:
        """A `record_routing_stats` result: a WorkerLoad as a dict, and `cached`."""
        t = stats.get("time")
        if t is None or not stats.get("num_total_blocks"):
            return
        f = self.get(replica)
        if t == f.poll_time:  # the same poll, broadcast again
            return
        f.poll_time = t
        load = WorkerLoad.from_dict(stats)
        self.observe_load(
            replica,
            load.num_free_blocks,
            load.num_total_blocks,
            load.num_running,
            load.num_waiting,
            t,
            load.num_waiting_tokens,
            load.loras,
        )
        f.offloaded = frozenset(stats.get("offloaded", ()))
        f.tier_ratio, f.cluster_ratio = tier_ratios(load.kv_tiers, load.prefill_us_per_token, self.block_size)
        cutoff = t - self.grace_s
        # Least recent first; assumed hashes sent since the poll's cutoff stay.
        held = dict.fromkeys(reversed(stats.get("cached", ())), 0.0)
        with self._lock:
            for h, sent_at in f.held.items():
                if sent_at > cutoff:
                    held[h] = sent_at
            f.held = _bounded(held)

    def _supersede(self, f: ReplicaFigures, cutoff: float) -> None:
        """Drop sends made before `cutoff`: the report counts them."""
        while f.sent:
            rid, (blocks, tokens, at) = next(iter(f.sent.items()))
            if at > cutoff:
                break
            del f.sent[rid]
            f.sent_blocks -= blocks
            f.sent_tokens -= tokens

    # ---- what this process sends ----------------------------------------------

    def reserve(
        self,
        request_id: str,
        replica: str,
        blocks: int,
        hashes: Sequence[bytes] = (),
        now: float | None = None,
        tokens: int = 0,
        group: str | None = None,
        lora: str | None = None,
    ) -> None:
        """Count a request as sent to `replica` (again: moved there): the
        KV blocks and the prefill tokens it takes there. `group`: its
        parallel-sampling group (GenerateRequest.parent_request_id), placed
        where its first member is reserved (group_replica); `lora`: its
        adapter, taken as loaded there from now on."""
        prev = self._where.get(request_id)
        if prev == replica:
            return
        now = time.time() if now is None else now
        f = self.get(replica)
        with self._lock:
            if request_id in self._ended:  # its stream ended already: nobody would call done()
                del self._ended[request_id]
                return
            if prev is not None:
                self._forget(request_id, prev)
            self._where[request_id] = replica
            if group is not None and request_id not in self._group_of:
                self._group_of[request_id] = group
                self._groups.setdefault(group, [replica, 0])[1] += 1
            f.sent[request_id] = (blocks, tokens, now)
            f.sent_blocks += blocks
            f.sent_tokens += tokens
            f.in_flight += 1
            if lora is not None:
                f.lora_sent[lora] = now
            if hashes and hashes[-1] not in f.held:  # (all held already: a repeat; leave them as they are)
                f.held.update(dict.fromkeys(hashes, now))
                if len(f.held) > MAX_HELD:
                    f.held = _bounded(f.held)

    def where(self, request_id: str) -> str | None:
        """The replica a request in flight was sent to."""
        return self._where.get(request_id)

    def group_replica(self, group: str) -> str | None:
        """Where a parallel-sampling group's members go, while one is in flight."""
        entry = self._groups.get(group)
        return None if entry is None else entry[0]

    def ack(self, request_id: str) -> None:
        """The request's first message came back: its worker counts it now."""
        replica = self._where.get(request_id)
        if replica is not None:
            f = self.get(replica)
            with self._lock:
                sent = f.sent.pop(request_id, None)
                if sent is not None:
                    f.sent_blocks -= sent[0]
                    f.sent_tokens -= sent[1]

    def done(self, request_id: str) -> None:
        """The request's stream ended (finished, refused, failed or cancelled)."""
        replica = self._where.get(request_id)
        with self._lock:
            if replica is not None:
                self._forget(request_id, replica)
            else:  # not reserved (yet): Serve may still be choosing a replica for it
                _remember(self._ended, request_id)

    def _forget(self, request_id: str, replica: str) -> None:
        f = self.get(replica)
        sent = f.sent.pop(request_id, None)
        if sent is not None:
            f.sent_blocks -= sent[0]
            f.sent_tokens -= sent[1]
        if self._where.pop(request_id, None) is not None:
            f.in_flight -= 1
        group = self._group_of.pop(request_id, None)
        if group is not None and (entry := self._groups.get(group)) is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._groups[group]

    # ---- replicas coming and going --------------------------------------------

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget replicas not in `replicas` (stopped, replaced)."""
        keep = set(replicas)
        for replica in keep & self._departed.keys():  # declared dead, yet listed again
            self._departed.pop(replica, None)
        for replica in [r for r in self.replicas if r not in keep]:
            self.drop(replica)

    def drop(self, replica: str) -> None:
        with self._lock:
            present = self.replicas.pop(replica, None) is not None
            self.version += 1
            for rid in [rid for rid, r in self._where.items() if r == replica]:
                del self._where[rid]
                self._group_of.pop(rid, None)
            for group in [g for g, (r, _) in self._groups.items() if r == replica]:
                del self._groups[group]
            _remember(self._departed, replica)
            listeners = [m() for m in self._on_departure]
            self._on_departure = [m for m, fn in zip(self._on_departure, listeners) if fn is not None]
        if present:
            for fn in listeners:
                if fn is not None:
                    fn(replica)

    def on_departure(self, method: Callable[[str], None]) -> None:
        """Call the bound `method` with a replica's name when it is dropped;
        held weakly, so a router's metrics in a test do not outlive it here."""
        with self._lock:
            self._on_departure = [m for m in self._on_departure if m() is not None] + [weakref.WeakMethod(method)]

    def departed(self, replica: str) -> bool:
        """The replica was dropped (and not listed since), lately."""
        return replica in self._departed

    def num_request_entries(self) -> int:
        """Entries keyed by request id of requests in flight (the ids
        remembered as ended are capped at MAX_REMEMBERED)."""
        n = len(self._where) + len(self._group_of) + len(self._groups)
        return n + sum(len(f.sent) for f in list(self.replicas.values()))


def tier_ratios(kv_tiers: dict[str, dict], prefill_us_per_token: float, block_size: int) -> tuple[float, float]:
    """(the host and disk tiers', the cluster tier's) cost of a block fetched
    against one prefilled, from a report's measures (DEFAULT_FETCH_RATIO for
    a tier not measured yet; -1.0 for no cluster tier)."""

    def ratio(names: tuple[str, ...]) -> float:
        blocks = sum(kv_tiers[n].get("loaded_blocks", 0) for n in names if n in kv_tiers)
        us = sum(kv_tiers[n].get("load_us", 0) for n in names if n in kv_tiers)
        if not blocks or not us or prefill_us_per_token <= 0 or not block_size:
            return DEFAULT_FETCH_RATIO
        return min(1.0, us / blocks / (prefill_us_per_token * block_size))

    return ratio(("host", "disk")), (ratio(("cluster",)) if "cluster" in kv_tiers else -1.0)


def _remember(seen: OrderedDict, key: str) -> None:
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > MAX_REMEMBERED:
        seen.popitem(last=False)


def _bounded(held: dict[bytes, float]) -> dict[bytes, float]:
    over = len(held) - MAX_HELD
    return dict(islice(held.items(), over, None)) if over > 0 else held


REGISTRY = ReplicaStats()
