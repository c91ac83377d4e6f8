"""The cluster tier's store, a Serve deployment of one replica in the
application (deployed with the workers under --kv-cluster-tier object-store,
and gone with them).

A worker sends it the blocks it computes; it puts each into Ray's object
store and keeps the reference in its index (workers/kv_transfer/
cluster_store.py: least recently used first, bounded in bytes). The blocks
are so this replica's objects, and outlive the worker that computed them,
which a stream resumed after its worker died needs: an object belongs to
the process that put it and dies with it, and Ray (2.56) no longer lets a
worker put an object owned by another. A fetch gets references and reads
the blocks from the object store, without a copy on this replica's node.
An evicted key's reference is dropped, and Ray frees the block.

Every block crosses to this replica's node once. One store per node, each
indexed cluster-wide, would keep a publish on its own node: the next step
when clusters outgrow one node's object store.

If this replica dies, its objects die with it, and Serve starts a fresh,
empty one: later loads miss, and are computed.
"""

from __future__ import annotations

from shoal.workers.kv_transfer.cluster_store import KVStore

__all__ = ["KVStore"]
