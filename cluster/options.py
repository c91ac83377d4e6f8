"""The served cluster's options: one dataclass behind `shoal serve`'s flags and
the `args` of a Serve config file (deploy/serve.yaml)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from shoal.router.fronts.cache_isolation import CACHE_ISOLATION_MODES
from shoal.router.fronts.tls import check_tls_options
from shoal.router.fronts.tool_parsers import TOOL_PARSERS
from shoal.router.options import RouterOptions
from shoal.router.routing.policies import DEFAULT_POLICY, POLICY_NAMES, get_policy, routing_help
from shoal.workers.engine_args import EngineArgs, add_dataclass_args, cli_field, dataclass_from_cli_args

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineArgs))
# The Helm chart sets it on every pod; read once here, the option is what the code reads.
_ENV_KUBERAY = os.environ.get("SHOAL_KUBERAY") == "1"


@dataclass(slots=True)
class ServeOptions:
    host: str = cli_field("127.0.0.1", "interface both servers listen on; 0.0.0.0 in a pod")
    http_port: int = cli_field(8000, "OpenAI HTTP port")
    grpc_port: int = cli_field(9000, "gRPC port")
    num_workers: int = cli_field(1, "worker replicas (each with --tensor-parallel-size GPUs on a GPU cluster)")
    routers: int = cli_field(
        1,
        "router replicas, at most one per node (on nodes with the Ray resource shoal_router "
        "when the cluster has it); each binds both ports on its node",
    )
    nodes_join_later: bool = cli_field(
        _ENV_KUBERAY,
        "the cluster's node groups (router pods, GPU pods) may join "
        "after the app is built, as under the Helm chart ($SHOAL_KUBERAY=1 "
        "sets the default on): routers go to shoal_router nodes before "
        "any has joined, and GPUs are not counted up front",
    )
    api_key: str | None = cli_field(None, "require this bearer key (default: $SHOAL_API_KEY)")
    max_waiting: int = cli_field(256, "waiting requests per worker; past it 429 / RESOURCE_EXHAUSTED")
    max_request_bytes: int = cli_field(4 << 20, "request body limit")
    max_prompts: int = cli_field(64, "most prompts one completions request may batch")
    max_concurrent_requests: int = cli_field(
        1024,
        "sequences one router serves at once, a request counting prompts x max(n, best_of), "
        "and at most as many HTTP requests and gRPC calls; past it 429 / RESOURCE_EXHAUSTED, "
        "and a request larger than all of it 400 (open connections: --max-connections)",
    )
    max_tokens_per_request: int | None = cli_field(
        None,
        "tokens one request may reserve: its prompts' tokens plus max_tokens for each of its sequences; "
        "a max_tokens that does not fit is 400, the chat default (the rest of the context) shrinks to fit "
        "(default: the model's context length)",
    )
    max_stream_buffer_tokens: int = cli_field(
        4096,
        "tokens a router holds for one stream whose client does not read (merged into one delta); "
        "past it the request is aborted",
    )
    tokenizer_threads: int = cli_field(
        2, "threads per router that tokenize and apply chat templates off its event loop"
    )
    allow_client_priority: bool = cli_field(
        False,
        "honour the gRPC request's priority field (the scheduler's queue "
        "order and preemption); off: a non-zero value is INVALID_ARGUMENT",
    )
    allowed_hosts: str | None = cli_field(
        None,
        "Host header values the HTTP API answers, comma-separated "
        "(default: any when an API key is set, else loopback names "
        "only, against DNS rebinding)",
    )
    tool_call_parser: str | None = cli_field(
        None,
        'how the chat API reads tool calls in a reply under tool_choice "auto" (the default with tools): '
        "hermes (Qwen 2.5/3, Hermes), llama3_json (Llama 3.x), pythonic (Llama 3.2/4); unset, auto is refused",
        choices=tuple(sorted(TOOL_PARSERS)),
    )
    allow_runtime_lora_updating: bool = cli_field(
        False,
        "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key): clients "
        "then make the workers read adapter files from paths they name, so set an API key too",
    )
    metrics_include_lora_names: bool = cli_field(
        False,
        "name the adapters in shoal:lora_requests_info (/metrics answers without the API key); "
        "off: how many adapters the running and the waiting requests use",
    )
    cache_isolation: str | None = cli_field(
        None,
        "which callers may share prefix-cache blocks (and so learn from cached_tokens or timing that "
        "another sent a prompt): key = only callers of the same API key identity, each request's "
        "cache_salt apart; none = any, unless their cache_salt differs (default: key when an API key "
        "is set, else none)",
        choices=CACHE_ISOLATION_MODES,
    )
    drain_timeout_s: float = cli_field(30.0, "seconds streams get to finish on shutdown", aliases=("--drain-timeout",))
    http_header_timeout_s: float = cli_field(
        10.0,
        "seconds a client gets to send a request's line and headers, from connecting or from its first "
        "byte after an idle wait; then the connection is closed (gRPC: the connection's handshake)",
    )
    http_body_timeout_s: float = cli_field(
        30.0, "seconds a client gets to send a request's whole body once its headers are in; then 408"
    )
    http_keep_alive_timeout_s: float = cli_field(
        5.0, "seconds an HTTP connection may idle between requests", aliases=("--timeout-keep-alive",)
    )
    max_connections: int | None = cli_field(
        None,
        "connections each of the router's servers (HTTP, gRPC) holds open at once; past it a new one is "
        "closed (HTTP: with a 503). Default and ceiling: half of the open-files limit left after a headroom",
    )
    ssl_keyfile: str | None = cli_field(None, "TLS: the private key (PEM) for HTTPS and gRPC over TLS")
    ssl_certfile: str | None = cli_field(
        None, "TLS: the certificate chain (PEM); with --ssl-keyfile both ports serve TLS only"
    )
    ssl_ca_certs: str | None = cli_field(
        None, "TLS: CA certificates (PEM) that client certificates are checked against"
    )
    ssl_cert_reqs: int = cli_field(
        0,
        "TLS client certificates: 0 not asked, 1 checked when sent (HTTPS only), 2 required (needs --ssl-ca-certs)",
        choices=(0, 1, 2),
    )
    cpus_per_worker: float = cli_field(1.0, "Ray CPUs a CPU worker asks for")
    max_retries: int = cli_field(
        3,
        "times one request is sent on to another worker after its worker is lost; "
        "past it the client gets 503 / UNAVAILABLE",
    )
    stall_timeout_s: float = cli_field(
        60.0,
        "a worker whose engine makes no progress this many seconds while it has "
        "work fails its health check and its requests move on; 0 = never",
        aliases=("--stall-timeout",),
    )
    # The Worker deployment's request router (router/routing/request_router.py); the policies: router/routing/policies/.
    routing: str = cli_field(DEFAULT_POLICY, routing_help(), choices=POLICY_NAMES)
    # Autoscaling on queue depth (cluster/autoscaling.py): on with max_workers.
    min_workers: int | None = cli_field(None, "autoscaling: the fewest workers (default 1); needs --max-workers")
    max_workers: int | None = cli_field(
        None,
        "autoscale the workers up to this many on queue depth, starting at --num-workers; unset: --num-workers, fixed",
    )
    target_queue_depth: float = cli_field(2.0, "autoscaling: waiting requests per worker to aim at; more add workers")
    upscale_delay_s: float = cli_field(
        5.0,
        "autoscaling: seconds the queue must call for more workers before they are added",
        aliases=("--upscale-delay",),
    )
    downscale_delay_s: float = cli_field(
        120.0,
        "autoscaling: seconds the load must allow fewer workers before one drains and goes",
        aliases=("--downscale-delay",),
    )
    # model, device, num_threads (default: cores / (workers x ranks)), ...
    engine: EngineArgs = field(default_factory=EngineArgs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        EngineArgs.add_cli_args(parser)
        add_dataclass_args(parser, cls, "serving", skip=("engine",))
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServeOptions:
        opts = dataclass_from_cli_args(cls, ns, engine=EngineArgs.from_cli_args(ns))
        opts.validate()
        return opts

    @classmethod
    def from_dict(cls, d: dict | None) -> ServeOptions:
        """From a Serve config's `args`: EngineArgs fields at the top level
        or in an `engine` mapping."""
        d = dict(d or {})
        engine = dict(d.pop("engine", None) or {})
        own = {f.name for f in dataclasses.fields(cls)}
        for key in list(d):
            if key in _ENGINE_FIELDS:
                engine[key] = d.pop(key)
            elif key not in own:
                raise ValueError(f"unknown option {key!r}")
        if bad := sorted(engine.keys() - _ENGINE_FIELDS):
            raise ValueError(f"unknown engine option {bad[0]!r}")
        opts = cls(**d, engine=EngineArgs(**engine))
        opts.validate()
        return opts

    def to_dict(self) -> dict:
        """The flat Serve config `args` that from_dict reads back."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"}
        return {**dataclasses.asdict(self.engine), **own}

    def validate(self) -> None:
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if self.routers < 1:
            raise ValueError("routers must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        for name in ("max_prompts", "max_concurrent_requests", "tokenizer_threads", "max_stream_buffer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must be >= 0 (0: never)")
        if self.max_tokens_per_request is not None and self.max_tokens_per_request < 2:
            raise ValueError("max_tokens_per_request must be >= 2 (a prompt token and an output token)")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        check_tls_options(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs, self.ssl_cert_reqs)
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a port number")
        self._validate_autoscaling()
        get_policy(self.routing)  # an unknown name: a ValueError naming the known ones
        if self.allow_runtime_lora_updating and not self.engine.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}; got {self.tool_call_parser!r}"
            )
        if self.cache_isolation is not None and self.cache_isolation not in CACHE_ISOLATION_MODES:
            raise ValueError(
                f"cache_isolation must be one of {', '.join(CACHE_ISOLATION_MODES)}; got {self.cache_isolation!r}"
            )

    def _validate_autoscaling(self) -> None:
        if self.max_workers is None:
            if self.min_workers is not None:
                raise ValueError("min_workers needs max_workers (autoscaling is on with max_workers)")
            return
        low = 1 if self.min_workers is None else self.min_workers
        if low < 1:
            raise ValueError("min_workers must be >= 1")
        if self.max_workers < low:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers ({low})")
        if self.target_queue_depth <= 0:
            raise ValueError("target_queue_depth must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")

    @property
    def tp_size(self) -> int:
        return self.engine.tensor_parallel_size

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("SHOAL_API_KEY") or None

    def uses_gpu(self) -> bool:
        device = self.engine.device
        if device.startswith("cuda"):
            return True
        if device != "auto":
            return False
        import ray

        if ray.is_initialized():
            return ray.cluster_resources().get("GPU", 0) > 0
        import torch

        return torch.cuda.is_available()

    def worker_engine_args(self, gpu: bool) -> EngineArgs:
        """What one worker replica gets: the engine, on its device and its share of the cores."""
        # On GPU workers "auto" is settled inside the worker, which sees its
        # own GPUs (logical GPUs of a test cluster have no CUDA behind them).
        device = self.engine.device if gpu else "cpu"
        # Used wherever a rank runs on the CPU: the ranks share the cores.
        workers = self.max_workers or self.num_workers  # autoscaling: as many as may run at once
        threads = self.engine.num_threads or max(1, (os.cpu_count() or 1) // (workers * self.tp_size))
        return dataclasses.replace(self.engine, device=device, num_threads=threads)

    def check_cluster(self) -> None:
        """Refuse, before anything deploys, a tensor-parallel size the model
        cannot split or the cluster cannot place (Serve would wait forever)."""
        from shoal.workers.model_executor.loader.model_loader import load_model_files

        load_model_files(self.engine.model).config.check_tp_size(self.tp_size, self.engine.enable_expert_parallel)
        import ray

        # Under the Helm chart GPU pods join as the Ray autoscaler or KubeRay brings them: not countable yet.
        if self.tp_size > 1 and ray.is_initialized() and self.uses_gpu() and not self.nodes_join_later:
            need, have = self.num_workers * self.tp_size, ray.cluster_resources().get("GPU", 0)
            if have < need:
                raise ValueError(
                    f"{self.num_workers} worker(s) x tensor_parallel_size {self.tp_size} need "
                    f"{need} GPUs; the cluster has {have:g}"
                )

    def router_options(self) -> RouterOptions:
        # No api_key: the replicas read $SHOAL_API_KEY (router/options.py), never pickled init args.
        return RouterOptions(
            self.engine.model,
            self.host,
            self.http_port,
            self.grpc_port,
            self.num_workers,
            self.max_request_bytes,
            self.drain_timeout_s,
            self.max_retries,
            self.routing,
            max_prompts=self.max_prompts,
            max_concurrent_requests=self.max_concurrent_requests,
            max_tokens_per_request=self.max_tokens_per_request,
            max_stream_buffer_tokens=self.max_stream_buffer_tokens,
            tokenizer_threads=self.tokenizer_threads,
            allow_client_priority=self.allow_client_priority,
            allowed_hosts=self.allowed_hosts,
            tool_call_parser=self.tool_call_parser,
            allow_runtime_lora_updating=self.allow_runtime_lora_updating,
            lora_root=self.engine.lora_root,
            max_runtime_loras=self.engine.max_runtime_loras,
            metrics_include_lora_names=self.metrics_include_lora_names,
            http_header_timeout_s=self.http_header_timeout_s,
            http_body_timeout_s=self.http_body_timeout_s,
            http_keep_alive_timeout_s=self.http_keep_alive_timeout_s,
            max_connections=self.max_connections,
            ssl_keyfile=self.ssl_keyfile,
            ssl_certfile=self.ssl_certfile,
            ssl_ca_certs=self.ssl_ca_certs,
            ssl_cert_reqs=self.ssl_cert_reqs,
            cache_isolation=self.cache_isolation,
        )
