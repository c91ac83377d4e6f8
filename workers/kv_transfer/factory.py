"""--kv-connector: the connector an engine runs, by name or by import path.

A new transport plugs in here: a class implementing KVConnectorBase
(base.py), named as "package.module:ClassName" (vLLM's
kv_connector_module_path), or added to CONNECTORS."""

from __future__ import annotations

import importlib

import torch

from shoal.workers.kv_transfer.base import KVCacheSpec, KVConnectorBase, KVConnectorRole

CONNECTORS = {"offloading": "shoal.workers.kv_transfer.offloading:OffloadingConnector"}


def connector_name(args) -> str | None:
    """The connector the settings ask for: --kv-connector, else offloading
    when a tier is given (as vLLM's --kv-offloading-size implies it)."""
    if args.kv_connector:
        return args.kv_connector
    tiers = args.kv_offload_host_bytes or args.kv_offload_disk_path or args.kv_cluster_tier
    return "offloading" if tiers else None


def connector_class(name: str) -> type[KVConnectorBase]:
    path = CONNECTORS.get(name, name)
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        known = ", ".join(sorted(CONNECTORS))
        raise ValueError(f"kv_connector {name!r}: expected one of {known}, or 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kv_connector {name!r}: cannot import {path}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"kv_connector {name!r}: {path} is not a KVConnectorBase")
    return cls


def kv_cache_spec(cfg, block_size: int, kv_dtype: torch.dtype, tp_size: int, fingerprint: bytes = b"") -> KVCacheSpec:
    """The paged cache one rank holds (cfg: the model's ModelConfig)."""
    from shoal.workers.model_executor.layers.parallel_state import num_local_kv_heads

    heads = num_local_kv_heads(cfg.num_key_value_heads, tp_size)
    return KVCacheSpec(cfg.num_hidden_layers, block_size, heads, cfg.head_dim, kv_dtype, fingerprint, tp_size)


def make_connector(args, role: KVConnectorRole, spec: KVCacheSpec) -> KVConnectorBase | None:
    name = connector_name(args)
    return None if name is None else connector_class(name)(role, spec, args)
