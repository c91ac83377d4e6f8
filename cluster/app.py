"""The Ray Serve application: a Router replica in front of the Worker deployment.

`build_app` is the import path a Serve config names (deploy/serve.yaml, a
KubeRay RayService): `serve run deploy/serve.yaml`. `shoal serve` builds the
same application from its flags.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from ray import serve
from ray.serve import Application

from shoal.cluster.autoscaling import replica_options
from shoal.cluster.kv_store import KVStore
from shoal.cluster.options import ServeOptions
from shoal.proto.tracing import otel_env
from shoal.router.fronts.ingress import Router
from shoal.router.options import API_KEY_ENV
from shoal.router.routing.request_router import request_router_config
from shoal.workers.distributed.placement import tp_bundles
from shoal.workers.kv_transfer.cluster_tier import STORE_DEPLOYMENT

# Nodes for routers carry this custom Ray resource (e.g. `ray start --resources
# '{"shoal_router": 1}'`); each router asks for a sliver of it, so any amount marks a node.
ROUTER_RESOURCE = "shoal_router"
ROUTER_RESOURCE_SHARE = 0.01
# Serve's own queue in front of a worker must never be what holds a request
# back: the engine admits up to max_num_seqs and max_waiting, and refuses the rest.
HEADROOM = 64
# Every streamed delta crosses these replicas; running user code and the
# handle's router on the replica's own event loop saves two thread hops per
# delta (the engine has its own thread, so nothing blocks that loop).
_ONE_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_runtime_env() -> dict:
    """Every replica's runtime_env: one event loop, and the OTEL_* settings
    of the process building the app (`shoal serve`'s shell), so tracing is
    configured the same everywhere. A Serve config sets OTEL_* in the
    application's runtime_env, which Serve merges into these env_vars."""
    return {"env_vars": {**_ONE_LOOP, **otel_env()}}


def worker_deployment_options(opts: ServeOptions, gpu: bool) -> dict:
    """The Worker deployment's `.options(...)`: replicas, resources, queue, health."""
    actor = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": opts.cpus_per_worker}
    actor["runtime_env"] = replica_runtime_env()
    options = {
        # --num-workers, or autoscaling between --min-workers and --max-workers
        **replica_options(opts),
        "ray_actor_options": actor,
        # (+ one each router's delta stream holds open, router/routing/delta_mux.py)
        "max_ongoing_requests": opts.engine.max_num_seqs + opts.max_waiting + HEADROOM + opts.routers,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 60.0,
        "graceful_shutdown_timeout_s": opts.drain_timeout_s + 5.0,
        # --routing: how every handle to the workers picks a replica.
        "request_router_config": request_router_config(opts.routing),
    }
    if opts.tp_size > 1:
        # One STRICT_PACK group per replica: the replica (rank 0) in bundle 0,
        # its other ranks in the rest; Serve replaces the group as a whole.
        options["placement_group_bundles"] = tp_bundles(opts.tp_size, gpu, actor["num_cpus"])
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def kv_store_deployment_options() -> dict:
    """The KVStore deployment's: one replica, a sliver of a CPU (it keeps an index; the
    blocks are in the object store). Its actor owns every block: it is never autoscaled."""
    return {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0.1, "runtime_env": replica_runtime_env()},
        "max_ongoing_requests": 1000,
        "health_check_period_s": 5.0,
    }


def router_deployment_options(opts: ServeOptions) -> dict:
    """The Router deployment's `.options(...)`: --routers replicas, at most
    one per node (each binds the HTTP and gRPC ports on its node), on the
    nodes that carry ROUTER_RESOURCE when the cluster has any."""
    actor = {"num_cpus": 0, "runtime_env": replica_runtime_env()}
    if cluster_has_router_nodes(opts.nodes_join_later):
        actor["resources"] = {ROUTER_RESOURCE: ROUTER_RESOURCE_SHARE}
    return {
        "num_replicas": opts.routers,
        "max_replicas_per_node": 1,
        "ray_actor_options": actor,
        "max_ongoing_requests": 1000,
        "graceful_shutdown_timeout_s": opts.drain_timeout_s + 10.0,
    }


def cluster_has_router_nodes(nodes_join_later: bool = False) -> bool:
    """Whether a live node of the connected Ray cluster carries ROUTER_RESOURCE.

    Read when the application is built: by `shoal serve` on its driver, and,
    for a Serve config (`serve run`/`serve deploy`, a KubeRay RayService), in
    the task Serve runs on the cluster to call build_app. So placement follows
    the nodes alive then: marked nodes that join later count from the next
    deploy, except with ServeOptions.nodes_join_later (the Helm chart), whose
    router pods are marked from the start. Outside Ray (False) the routers may go to any node."""
    import ray

    if nodes_join_later:  # the chart's router pods carry it, whether or not they have joined yet
        return True
    return ray.is_initialized() and ray.cluster_resources().get(ROUTER_RESOURCE, 0) > 0


@contextmanager
def api_key_for_local_cluster(key: str | None):
    """Put the API key in this process's environment while a local Ray cluster
    starts in it: the raylet inherits it, and so every replica it forks, and
    the Router reads it there. Serve's init args and runtime_env are stored in
    the cluster (and shown by its dashboard), so the key never goes through them."""
    before = os.environ.get(API_KEY_ENV)
    if key:
        os.environ[API_KEY_ENV] = key
    try:
        yield
    finally:
        if key and before is None:
            del os.environ[API_KEY_ENV]
        elif key:
            os.environ[API_KEY_ENV] = before


def check_api_key(opts: ServeOptions) -> None:
    """A key in the options that this process's environment does not carry
    would reach no router: refuse it rather than serve an open API."""
    if opts.api_key and opts.api_key != os.environ.get(API_KEY_ENV):
        raise ValueError(
            "api_key reaches the routers only as $SHOAL_API_KEY in the Ray nodes' environment "
            "(a Kubernetes Secret under the Helm chart), never in a Serve config's args"
        )


def build_app(args: dict | ServeOptions | None = None) -> Application:
    """The application for `serve run` / `serve deploy`; args are ServeOptions.to_dict()'s."""
    opts = args if isinstance(args, ServeOptions) else ServeOptions.from_dict(args)
    check_api_key(opts)
    opts.check_cluster()
    gpu = opts.uses_gpu()
    from shoal.workers.worker import Worker  # the engine (torch): only when an application is built

    worker = serve.deployment(Worker, name="Worker").options(**worker_deployment_options(opts, gpu))
    router = serve.deployment(Router, name="Router").options(**router_deployment_options(opts))
    engine_args = opts.worker_engine_args(gpu)
    kv_store = None
    if engine_args.kv_cluster_tier == "object-store":  # the cluster tier's index, one replica (cluster/kv_store.py)
        store = serve.deployment(KVStore, name=STORE_DEPLOYMENT).options(**kv_store_deployment_options())
        kv_store = store.bind(engine_args.kv_cluster_bytes)
    workers = worker.bind(engine_args, opts.max_waiting, stall_timeout_s=opts.stall_timeout_s, kv_store=kv_store)
    return router.bind(workers, opts.router_options())
