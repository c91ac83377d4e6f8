"""The KV connector seam, in vLLM v1's shape (KVConnectorBase_V1), so that a
tier or a transport plugs in as one object and its authors find the names
they know.

A connector has two sides, made from one class. The scheduler side (role
SCHEDULER, beside the Scheduler) knows which blocks a tier holds and
decides, each step, what moves: it finds the tokens a tier can give a new
request past its device prefix hits, learns the blocks allocated for them,
and writes the step's moves into its metadata. The worker side (role
WORKER, one per tensor-parallel rank, beside the ModelRunner) holds the
tiers' storage and makes those moves: before the forward writes any block,
and after it.

Every key is a block's prefix-cache key (proto/block_hash.py) under the
engine's fingerprint (kv_transfer/keys.py), so a block found in a tier holds
the very keys and values the request would compute.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from shoal.workers.core.kv_connector import SchedulerConnector
    from shoal.workers.core.outputs import KVConnectorOutput
    from shoal.workers.core.sequence import Sequence


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # beside the scheduler, on rank 0
    WORKER = 1  # beside each rank's model runner


class KVConnectorMetadata:
    """What the scheduler side tells the worker side about one step."""

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to do (a pass of its own is then skipped)."""
        return False


@dataclass(slots=True)
class KVCacheSpec:
    """What a connector needs to know of the paged cache it serves."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype  # the paged cache's
    # The engine's (keys.py): what a block's contents depend on beyond its tokens. Only the
    # scheduler side keys blocks; a worker side is told slots and keys, and gets b"".
    fingerprint: bytes = b""
    num_ranks: int = 1  # tensor-parallel ranks, each holding its heads' slice of every block


class KVLoadError(RuntimeError):
    """Raised by a worker side whose loads failed, before the forward runs:
    the blocks named hold nothing usable and are computed again."""

    def __init__(self, block_ids: Iterable[int], reason: str):
        self.block_ids = set(block_ids)
        super().__init__(f"{len(self.block_ids)} KV block(s) failed to load: {reason}")


class KVConnectorBase(ABC):
    """vLLM's KVConnectorBase_V1, less what shoal has no use for yet
    (handshakes for disaggregated prefill, hidden states).

    Scheduler side, called by the Scheduler on the engine thread:
    get_num_new_matched_tokens, update_state_after_alloc,
    build_connector_meta, on_block_evicted, request_finished, discard.
    Worker side, called by each rank's ModelRunner: register_kv_caches,
    start_load_kv (before the forward), wait_for_layer_load and
    save_kv_layer (around each attention layer, only when a connector
    overrides them: the fused CPU decode step and CUDA graphs, which skip
    the layers' Python, are then off), wait_for_save (after the forward),
    get_finished (loads and sends that span steps). The offloading connector
    moves a block in one contiguous copy across layers before the forward,
    so it needs no per-layer hook."""

    def __init__(self, role: KVConnectorRole, spec: KVCacheSpec, options: Any):
        self.role = role
        self.spec = spec
        self.options = options  # the EngineArgs

    # ---- scheduler side ----------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens past num_computed_tokens (the device's prefix hits, whole
        blocks) that a tier holds, whether they load asynchronously, across
        steps). A whole number of blocks, never the prompt's last token (its
        logits are needed); None while the connector is still finding out
        (the request waits, and is asked again next step). It may be asked
        again for the same request. An asynchronous load leaves the request
        WAITING_FOR_REMOTE_KVS, holding its blocks and no step's budget,
        until the worker side's get_finished names it."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted: its num_external_tokens (as matched) go
        into block_ids (its blocks past the device hits, in order)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's moves, for every rank's worker side; resets what was
        gathered. scheduler_output: the step's SchedulerOutput (the scheduler
        imports this module, so it is not named here)."""

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """A cached block was handed out afresh: its contents, keyed
        block_hash, are overwritten by a later step unless saved now."""
        return None

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict | None]:
        """seq ended (finished or aborted), its blocks about to be freed: a
        connector that wants their contents copies them now. Returns (free
        later, params): True keeps the blocks until the worker side's
        get_finished names the request in finished_sending (a send in
        flight reads them); params, if any, are kept on the sequence
        (kv_transfer_params) for whoever receives the blocks."""
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side finished (its get_finished), before the
        scheduler acts on it: a failed load's blocks are no longer trusted."""
        return None

    def discard(self, block_hash: bytes) -> None:
        """Forget the block keyed block_hash: its load failed (KVLoadError), so what a tier holds is bad."""
        return None

    def stats(self) -> dict:
        """Counters by tier (hits, bytes, evictions, occupancy)."""
        return {}

    def take_events(self) -> list:
        """KV events (proto/kv_events.py) of the tiers since last taken, in
        order, with --enable-kv-cache-events; the engine logs them after the
        paged cache's own, each step."""
        return []

    def offloaded_hashes(self, n: int) -> list[bytes]:
        """Chain hashes (proto/block_hash.py) of up to n blocks this worker's
        own tiers hold past its paged pool, most recent first: the router
        scores a hit there below a device hit and above a miss."""
        return []

    # ---- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The rank's paged cache: [2, layers, blocks, block_size, kv_heads, head_dim]."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before attention layer layer_name reads its cache (its keys and
        values are written first): block until that layer's part of the
        step's loads is in place (a layer-by-layer transport)."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata: Any) -> None:
        """After attention layer layer_name ran: its (key, value) caches
        [blocks, block_size, kv_heads, head_dim] hold the step's new keys and
        values at attn_metadata.slot_mapping; start saving them."""
        return None

    @property
    def uses_layer_hooks(self) -> bool:
        """Whether this class overrides the per-layer hooks (the runner then calls them, layer by layer)."""
        cls = type(self)
        return (
            cls.wait_for_layer_load is not KVConnectorBase.wait_for_layer_load
            or cls.save_kv_layer is not KVConnectorBase.save_kv_layer
        )

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward: start (or make) the step's moves. Raises
        KVLoadError, having written nothing else, for blocks that cannot load."""

    def wait_for_save(self) -> None:
        """After the forward: every save of the step is done (or owned)."""
        return None

    def get_finished(self, timeout_s: float = 0.0) -> KVConnectorOutput | None:
        """The requests whose asynchronous loads landed (their blocks written,
        before any forward can read them) or failed since the last call;
        waits up to timeout_s for one when none has (the engine's pass with
        nothing else to run). None: nothing is in flight."""
        return None

    def shutdown(self) -> None:
        """Release the tiers' storage."""
        return None


if TYPE_CHECKING:

    def _scheduler_view(connector: KVConnectorBase) -> SchedulerConnector:
        """For mypy: every connector is what the scheduler asks of one."""
        return connector
