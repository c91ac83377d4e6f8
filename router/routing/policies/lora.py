"""Where LoRA adapters are, as the adapter-reading policies weigh it.

A request under an adapter adds what getting the adapter into a slot costs
at a replica, like a prefix miss: nothing where it sits in a device slot (or
this process just sent it a request under it), LORA_HOST_TOKENS where it is
in host memory, LORA_DISK_TOKENS where only its files are registered (both
plus LORA_HELD_TOKENS for each other adapter held there, in a slot or in
host memory, which the new one may push out: an adapter new to every
replica goes to the one holding the fewest, so adapters spread), and
DOES_NOT_FIT where the replica does not serve it at all (an adapter loaded
at run time after the replica started, or one whose files the replica
could not load: LORA_UNAVAILABLE, whatever this process sent it since).
`kv` adds it to its cost; the others that read adapters move such replicas
last (`serving_first`).
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.proto.lora.modules import LORA_IN_HOST, LORA_ON_DEVICE, LORA_ON_DISK, LORA_UNAVAILABLE
from shoal.router.routing.policies.base import DOES_NOT_FIT
from shoal.router.routing.replica_stats import ReplicaFigures

# Copying an adapter from host memory into a slot (and perhaps waiting for
# a slot to free), and reading it from disk first, in prompt tokens of
# prefill: a request goes to the replica that holds its adapter unless that
# one is busier by a few queued requests.
LORA_HOST_TOKENS = 256.0
LORA_DISK_TOKENS = 1024.0
LORA_HELD_TOKENS = 128.0


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
    taken = f.lora_sent.keys() | {n for n, (_, w) in f.loras.items() if w > LORA_ON_DISK}
    others = len(taken) - (lora in taken)
    return (LORA_HOST_TOKENS if where == LORA_IN_HOST else LORA_DISK_TOKENS) + LORA_HELD_TOKENS * others


def serving_first(order: list[int], figs: Sequence[ReplicaFigures], lora: str) -> list[int]:
    """`order` with the replicas that do not serve adapter `lora` moved last."""
    lacks = {i for i in order if lora_cost(figs[i], lora) >= DOES_NOT_FIT}
    return [i for i in order if i not in lacks] + [i for i in order if i in lacks]


def adapter_servers_first(order: list[int], figs: Sequence[ReplicaFigures], request) -> list[int]:
    """`order`, or for a request under an adapter, serving_first's."""
    lora = getattr(request, "lora_name", None)
    return order if lora is None else serving_first(order, figs, lora)
