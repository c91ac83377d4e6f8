"""The served cluster's options: one dataclass behind `shoal serve`'s flags and
the `args` of a Serve config file (deploy/serve.yaml)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from shoal.workers.engine_args import EngineArgs


@dataclass(slots=True)
class ServeOptions:
    model: str | None = None  # HF folder or .gguf file; None = SmolLM2-135M-Instruct
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    num_workers: int = 1
    device: str = "auto"  # auto: a GPU per worker where the cluster has GPUs, else CPU
    api_key: str | None = None  # default: $SHOAL_API_KEY
    max_waiting: int = 256  # per worker; past it a request gets 429 / RESOURCE_EXHAUSTED
    max_request_bytes: int = 4 << 20
    drain_timeout_s: float = 30.0
    cpus_per_worker: float = 1.0  # Ray CPUs a CPU worker asks for
    num_threads: int | None = None  # torch threads per CPU worker; default: cores / workers
    engine: dict = field(default_factory=dict)  # any other EngineArgs field

    @classmethod
    def from_dict(cls, d: dict | None) -> "ServeOptions":
        """From a Serve config's `args`; EngineArgs fields may sit at the top level."""
        d = dict(d or {})
        own = {f.name for f in dataclasses.fields(cls)}
        engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
        engine = dict(d.pop("engine", None) or {})
        for key in list(d):
            if key not in own:
                if key not in engine_fields:
                    raise ValueError(f"unknown option {key!r}")
                engine[key] = d.pop(key)
        opts = cls(**d, engine=engine)
        opts.validate()
        return opts

    def validate(self) -> None:
        if self.num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a port number")
        bad = set(self.engine) - {f.name for f in dataclasses.fields(EngineArgs)}
        if bad:
            raise ValueError(f"unknown engine options: {sorted(bad)}")

    @property
    def tp_size(self) -> int:
        return self.engine.get("tensor_parallel_size", 1)

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("SHOAL_API_KEY") or None

    def uses_gpu(self) -> bool:
        if self.device.startswith("cuda"):
            return True
        if self.device != "auto":
            return False
        import ray

        if ray.is_initialized():
            return ray.cluster_resources().get("GPU", 0) > 0
        import torch

        return torch.cuda.is_available()

    def engine_args(self, gpu: bool) -> dict:
        args = dict(self.engine, model=self.model)
        # On GPU workers "auto" is settled inside the worker, which sees its
        # own GPUs (logical GPUs of a test cluster have no CUDA behind them).
        args["device"] = ("auto" if self.device == "auto" else self.device) if gpu else "cpu"
        # Used wherever a rank runs on the CPU: the ranks share the cores.
        args["num_threads"] = self.num_threads or max(1, (os.cpu_count() or 1) // (self.num_workers * self.tp_size))
        return args

    def check_cluster(self) -> None:
        """Refuse, before anything deploys, a tensor-parallel size the model
        cannot split or the cluster cannot place (Serve would wait forever)."""
        from shoal.workers.model_executor.model_loader import load_model_files

        load_model_files(self.model).config.check_tp_size(self.tp_size)
        import ray

        if self.tp_size > 1 and ray.is_initialized() and self.uses_gpu():
            need, have = self.num_workers * self.tp_size, ray.cluster_resources().get("GPU", 0)
            if have < need:
                raise ValueError(f"{self.num_workers} worker(s) x tensor_parallel_size {self.tp_size} need "
                                 f"{need} GPUs; the cluster has {have:g}")  # fmt: skip

    def router_options(self) -> dict:
        return {"model": self.model, "host": self.host, "http_port": self.http_port, "grpc_port": self.grpc_port,
                "num_workers": self.num_workers, "api_key": self.resolved_api_key(),
                "max_request_bytes": self.max_request_bytes, "drain_timeout_s": self.drain_timeout_s}  # fmt: skip
