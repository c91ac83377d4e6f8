"""The Ray Serve config (deploy/serve.yaml's form, a KubeRay RayService's
serveConfigV2) that deploys the same application `shoal serve` would from
the same options: `shoal serve --print-config` prints it."""

from __future__ import annotations

import dataclasses

from shoal.cluster.options import ServeOptions
from shoal.workers.engine_args import EngineArgs

APP_NAME = "shoal"
IMPORT_PATH = "shoal.cluster.app:build_app"
# Never written into a config: the replicas read the key from $SHOAL_API_KEY
# (a Kubernetes Secret in the Helm chart), so it stays out of files and CRs.
SECRET_FIELDS = frozenset({"api_key"})


def serve_args(opts: ServeOptions) -> dict:
    """The application's `args`: the options that differ from their defaults,
    flat (ServeOptions.from_dict takes EngineArgs fields at the top level),
    in flag order. ServeOptions.from_dict(serve_args(opts)) == opts, but for
    the API key."""
    out = {}
    for obj, default in ((opts, ServeOptions()), (opts.engine, EngineArgs())):
        for f in dataclasses.fields(obj):
            if f.name == "engine" or f.name in SECRET_FIELDS:
                continue
            value = getattr(obj, f.name)
            if value != getattr(default, f.name):
                out[f.name] = value
    return out


def serve_config(opts: ServeOptions, otel_env: dict[str, str] | None = None) -> dict:
    """The whole Serve config for `opts`. `otel_env` (default: the OTEL_*
    variables of this process, as `shoal serve` forwards them) becomes the
    application's runtime_env, which Serve merges into every replica's."""
    if otel_env is None:
        from shoal.proto.tracing import otel_env as current

        otel_env = current()
    app: dict = {"name": APP_NAME, "route_prefix": None, "import_path": IMPORT_PATH}
    if otel_env:
        app["runtime_env"] = {"env_vars": dict(otel_env)}
    app["args"] = serve_args(opts)
    # The router binds the HTTP and gRPC ports itself, so Serve's proxies stay off.
    return {"proxy_location": "Disabled", "applications": [app]}
