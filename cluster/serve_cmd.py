"""`shoal serve`: start (or join) a Ray cluster, deploy the application, wait
for Ctrl-C, then drain and stop."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from shoal.cluster.options import ServeOptions
from shoal.cluster.serve_config import APP_NAME, serve_config


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over OpenAI HTTP and gRPC on a Ray cluster")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the Ray Serve config (serve.yaml, a RayService's serveConfigV2) these options make, "
        "with this shell's OTEL_* as its runtime_env, and exit without starting Ray",
    )
    ServeOptions.add_cli_args(p)
    p.set_defaults(func=cmd_serve)


def launch(opts: ServeOptions, address: str | None = None):
    """Start (or join) Ray, deploy the application, return the Router's handle."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from shoal.cluster.app import api_key_for_local_cluster, build_app

    key = None if address else opts.resolved_api_key()
    with api_key_for_local_cluster(key):  # the raylet this ray.init starts inherits it, so the Router does
        if address:
            ray.init(address=address, logging_level="WARNING")
        else:
            gpus = None if opts.engine.device in ("auto", "cuda") else 0
            # Logical CPUs: each rank of a CPU worker asks for one, whatever the core count.
            ranks = opts.num_workers * opts.tp_size
            ray.init(
                num_cpus=max(os.cpu_count() or 1, ranks * int(opts.cpus_per_worker + 0.999)),
                num_gpus=gpus,
                include_dashboard=False,
                logging_level="WARNING",
            )
        # The router binds the ports itself, so Serve's own proxies stay off.
        serve.start(proxy_location="Disabled")
        return serve.run(build_app(opts), name=APP_NAME, route_prefix=None)


def shut_down(address: str | None = None) -> None:
    """Delete the application; on a cluster this process started, stop Serve
    and Ray too. A joined cluster keeps running (and serving other apps)."""
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        if not address:
            serve.shutdown()
    finally:
        ray.shutdown()  # on a joined cluster this only disconnects


def router_endpoints(handle) -> list[dict]:
    """Every router replica's Router.endpoints(), from the Router deployment's handle."""
    handle.endpoints.remote().result()  # routed as usual: waits until the handle knows the replicas
    return handle.broadcast("endpoints").results()


def ready_message(opts: ServeOptions, ends: list[dict], ready_s: float) -> str:
    """What `shoal serve` prints once up: the endpoints, and with several
    routers the nodes that serve them (each router binds both ports on its node)."""
    e = ends[0]
    tp = f" of {opts.tp_size} ranks" if opts.tp_size > 1 else ""
    lines = [
        f"shoal: serving {e['model']} with {opts.num_workers} worker(s){tp}",
        f"  OpenAI HTTP  {e['http']}/v1",
        f"  gRPC         {e['grpc']} (shoal.v1.Shoal)",
    ]
    if len(ends) > 1:
        nodes = ", ".join(sorted(x["node"] for x in ends))
        lines.append(f"  routers      {len(ends)}, each on both ports on its node: {nodes}")
    lines.append(f"  ready in {ready_s:.1f} s; Ctrl-C stops")
    return "\n".join(lines)


def print_config(opts: ServeOptions) -> int:
    import yaml

    if opts.api_key:  # never written into a file: the replicas read $SHOAL_API_KEY
        print(
            "shoal serve: note: --api-key is left out of the config; give the replicas $SHOAL_API_KEY", file=sys.stderr
        )
    print(yaml.safe_dump(serve_config(opts), sort_keys=False), end="", flush=True)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    opts = ServeOptions.from_cli_args(ns)
    if ns.print_config:
        return print_config(opts)
    opts.check_cluster()  # a size that cannot split the model: refused before Ray starts
    if opts.api_key and ns.address:  # the routers there run in their nodes' environment, not this one's
        raise ValueError(
            "--api-key cannot reach the routers of a cluster started elsewhere: start its nodes "
            "(`ray start`) with SHOAL_API_KEY in their environment instead"
        )
    if opts.routers > 1 and not ns.address:  # Serve would leave the rest pending forever
        raise ValueError(
            f"--routers {opts.routers} needs {opts.routers} Ray nodes (one router per node) and a "
            "local cluster has one; start a cluster and pass --address"
        )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        handle = launch(opts, ns.address)
        print(ready_message(opts, router_endpoints(handle), time.perf_counter() - t0), flush=True)
        while not stop.wait(0.5):
            pass
        print("shoal: draining (new requests get 503 / UNAVAILABLE)...", flush=True)
        # Every router drains at once; one that is gone counts as none cut here.
        left = sum(
            n
            for n in handle.broadcast("drain", opts.drain_timeout_s).results(return_exceptions=True)
            if isinstance(n, int)
        )
        print(f"shoal: drained ({left} streams cut); stopping", flush=True)
    finally:
        shut_down(ns.address)
    print("shoal: stopped", flush=True)
    return 0
