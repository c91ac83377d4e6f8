"""Engine arguments, named as in vLLM where vLLM has the knob, and their
command-line flags, made from the fields as vLLM's arg_utils makes them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from shoal.workers.model_executor.layers.quantization import QUANTIZATION_METHODS

if typing.TYPE_CHECKING:
    import torch

# Names only: the router's processes read EngineArgs and never import torch (the engine resolves them).
_DTYPES = ("float32", "bfloat16", "float16")
# Older switches that still set the defaults, read once here: the options themselves are what the code reads.
_ENV_CPU_KERNELS = os.environ.get("SHOAL_CPU_KERNEL", "1") != "0"
_ENV_FUSED_OPS = os.environ.get("SHOAL_FUSED_OPS") == "1"


def cli_field(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field that becomes the flag --field-name; `flag` takes
    argparse's `choices` and `aliases` (more option strings)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of cls, typed by its annotation; a bool field gets
    --name / --no-name. The default is the field's, so it is written once."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        names = [f"--{f.name.replace('_', '-')}", *meta.pop("aliases", ())]
        help = meta.pop("help").replace("%", "%%") + ("" if f.default is None else " (default: %(default)s)")
        kind = _flag_type(hints[f.name])
        if kind is bool:
            how = {"action": argparse.BooleanOptionalAction}
        elif typing.get_origin(kind) is list:  # repeatable, several values each time: --x a b --x c
            how = {"type": typing.get_args(kind)[0], "nargs": "+", "action": "extend"}
        else:
            how = {"type": kind}
        group.add_argument(*names, dest=f.name, default=f.default, help=help, **how, **meta)


def _flag_type(hint: Any) -> type:
    """int for `int | None`: None is what the flag's absence gives."""
    if isinstance(hint, types.UnionType):
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return hint


def dataclass_from_cli_args(cls: type, ns: argparse.Namespace, **given: Any) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if f.name not in given}, **given)


@dataclass(slots=True)
class EngineArgs:
    model: str | None = cli_field(
        None, "HF folder, .gguf file or packaged model name (gemma-3-270m; default: SmolLM2-135M-Instruct)"
    )
    load_format: str = cli_field(
        "auto",
        "auto = the checkpoint's weights; dummy = random ones from the config alone "
        "(a folder with only config.json will do), for benchmarks; simulated = "
        "no weights: the real scheduler and KV block accounting over a stand-in "
        "model whose steps take --simulated-cost-model's time, for studying the "
        "router with more replicas than the machine can serve",
        choices=("auto", "dummy", "simulated"),
    )
    simulated_cost_model: str | None = cli_field(
        None,
        "load_format simulated: the step cost model, a JSON file "
        "written by `shoal bench calibrate` (default: coefficients "
        "measured on the development machine's CPU)",
    )
    dtype: str = cli_field(
        "auto",
        "auto = float32 on CPU (bfloat16 under --weight-dtype bfloat16 on a CPU with "
        "AVX512-BF16 or AMX), bfloat16 on GPU; bfloat16 on a CPU without either "
        "computes in float32 with the weights stored in bfloat16 (SHOAL_CPU_BF16=1 "
        "computes in bfloat16 anyway, slowly)",
        choices=("auto", *_DTYPES),
    )
    weight_dtype: str = cli_field(
        "auto",
        "auto = --dtype; bfloat16 stores the weight matrices (linear layers, "
        "embedding, LM head) in bfloat16: half the bytes a decode step reads. "
        "On a CPU with AVX512-BF16 or AMX (under --dtype auto) the model then "
        "computes in bfloat16 with float32 sums; else a float32 model widens "
        "them as it reads them and computes and accumulates in float32",
        choices=("auto", "bfloat16"),
    )
    quantization: str = cli_field(
        "auto",
        "how the weights are stored and multiplied: none = expanded to the "
        "model's dtype; gguf = a .gguf file's own blocks (Q4_0, Q4_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K), multiplied on the CPU with 8-bit activations and "
        "integer dot products as llama.cpp does; int8 = a float checkpoint's "
        "linear layers quantized at load to int8 per output channel, with "
        "8-bit activations per token (CPU integer kernels, Triton on GPU); "
        "fp8 = the same in float8_e4m3 with a per-tensor weight scale "
        "(torch._scaled_mm on Hopper); compressed-tensors = an llm-compressor "
        "checkpoint as stored (W8A8 int8/fp8, W4A16); auto = the checkpoint's "
        "own: gguf for a .gguf whose quantized matrices are all of those "
        "types, on the CPU; a folder's quantization_config; else none",
        choices=("auto", *QUANTIZATION_METHODS),
    )
    device: str = cli_field("auto", "cpu, cuda, cuda:N; auto = cuda when available")
    block_size: int = cli_field(16, "tokens per KV block")
    kv_cache_dtype: str = cli_field(
        "auto",
        "the KV cache's storage: auto = the model's dtype; fp8 (= fp8_e4m3) = float8_e4m3fn "
        "with a per-tensor scale per layer (the checkpoint's, else 1.0): one byte an "
        "element, so the same budget holds 2x the blocks of bfloat16, 4x of float32; needs "
        "attention backend torch or triton (auto picks one)",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    kv_cache_memory_bytes: int | None = cli_field(
        None, "KV budget in bytes (default: 2 GiB on CPU; on GPU what --gpu-memory-utilization leaves)"
    )
    gpu_memory_utilization: float = cli_field(
        0.9,
        "share of the GPU's total memory this engine may use: weights, "
        "the activation peak of one profiling forward, and the KV cache "
        "in what is left",
    )
    num_kv_blocks: int | None = cli_field(None, "KV budget in blocks (wins over bytes)")
    max_model_len: int | None = cli_field(None, "prompt + output cap (default: the model's context length)")
    max_num_batched_tokens: int = cli_field(2048, "tokens one step computes (the prefill chunk size)")
    max_num_seqs: int = cli_field(256, "sequences in one step")
    # Prefill under a queue of prompts (vLLM's scheduler knobs): chunks sized for time to first token.
    long_prefill_token_threshold: int = cli_field(
        0,
        "a prompt with more than this many tokens left to prefill is long, and no prompt prefills more than "
        "this many in one step, so a long one never holds up the prompts behind it or the running decodes "
        "for a whole chunk (0: off; with --max-num-partial-prefills above 1, 4% of the model length)",
    )
    max_num_partial_prefills: int = cli_field(
        1,
        "prompts whose prefill may be in progress (started, not complete) at once",
    )
    max_long_partial_prefills: int = cli_field(
        1,
        "of those, long ones (--long-prefill-token-threshold) at most: shorter prompts go ahead of long ones beyond it",
    )
    async_scheduling: bool = cli_field(
        False,
        "schedule and stage each step while the one before computes (on a thread of its own; one rank, no KV "
        "connector), and in AsyncEngine (the workers) detokenize and deliver each step's deltas on a second "
        "thread (requests with stop strings are detokenized in the step)",
    )
    # The alias also gives --no-prefix-caching, the flag's older spelling.
    enable_prefix_caching: bool = cli_field(
        True, "share KV blocks of common prompt prefixes", aliases=("--prefix-caching",)
    )
    seed: int = cli_field(0, "draws the sampling seeds of requests that bring none")
    kv_connector: str | None = cli_field(
        None,
        "the KV connector moving blocks between the paged cache and other tiers: offloading (host "
        "memory and disk), or a class of your own as package.module:ClassName (default: offloading "
        "when --kv-offload-host-bytes or --kv-offload-disk-path is set, else none)",
    )
    kv_offload_host_bytes: int = cli_field(
        0,
        "host memory that keeps KV blocks evicted from the paged cache, so a prefix that comes back "
        "is copied in instead of prefilled again, all tensor-parallel ranks together (0: no host tier)",
    )
    kv_offload_disk_path: str | None = cli_field(
        None,
        "a folder (an absolute path; one worker's) where the blocks of finished requests are written, "
        "so a prefix that comes back, even after a restart with the same model and settings, is read "
        "instead of prefilled again",
    )
    kv_offload_disk_bytes: int = cli_field(
        16 << 30,
        "the disk tier's size, all tensor-parallel ranks together: past it, the least recently used files are deleted",
    )
    kv_cluster_tier: str | None = cli_field(
        None,
        "a KV tier every worker shares: object-store keeps each computed block in Ray's object store, "
        "indexed by the application's KVStore deployment, so a prefix computed on any worker (or by a "
        "worker since gone) is fetched instead of prefilled again; off a Serve cluster, the engines of "
        "one process share it",
        choices=("object-store",),
    )
    kv_cluster_bytes: int = cli_field(
        4 << 30,
        "the cluster tier's size, every tensor-parallel rank's slices together: past it, the least recently "
        "used blocks are dropped",
    )
    kv_offload_dtype: str = cli_field(
        "auto",
        "the KV tiers' storage: auto = the KV cache's dtype (loads give back the very values); "
        "bfloat16 or float16 hold twice a float32 cache's blocks in the same bytes, rounded; fp8 (e4m3, "
        "unscaled: values past +-448 saturate) four times",
        choices=("auto", "bfloat16", "float16", "fp8"),
    )
    enable_kv_cache_events: bool = cli_field(
        False,
        "keep a stream of KV cache events (blocks stored in and removed from the cache and its host and "
        "disk tiers, vLLM's BlockStored / BlockRemoved) that a router or indexer can subscribe to",
    )
    kv_events_block_hash: str = cli_field(
        "shoal",
        "how KV events name blocks: shoal = the prefix-cache keys (SHA-256, as shoal's router computes "
        "them); dynamo = NVIDIA Dynamo's sequence hashes (XXH3-64, seed 1337; needs the xxhash package), "
        "for a Dynamo or llm-d router, of the paged cache's blocks without LoRA or cache_salt",
        choices=("shoal", "dynamo"),
    )
    num_threads: int | None = cli_field(None, "torch CPU threads (default: the cores, shared among ranks and workers)")
    attention_backend: str = cli_field(
        "auto",
        "auto: triton on CUDA (flash_attn, where installed, on request); "
        "on the CPU in float32 the compiled decode kernel when it builds, "
        "else torch (the reference)",
        choices=("auto", "torch", "cpu_kernel", "triton", "flash_attn"),
    )
    enforce_eager: bool = cli_field(
        False,
        "never replay CUDA graphs: every step runs eagerly (graphs capture "
        "decode-only steps at bucketed batch sizes on CUDA)",
    )
    cpu_kernels: bool = cli_field(
        _ENV_CPU_KERNELS,
        "build and use the compiled CPU kernels (csrc/: decode "
        "attention, few-row linear, norm, activation, rotary); off: the "
        "torch path, the reference ($SHOAL_CPU_KERNEL=0 sets the default "
        "off)",
    )
    fused_ops: bool = cli_field(
        _ENV_FUSED_OPS,
        "run the fused Triton norm, activation and rotary kernels off CUDA "
        "too (the tests, under TRITON_INTERPRET=1); on CUDA they always run "
        "($SHOAL_FUSED_OPS=1 sets the default on)",
    )
    tensor_parallel_size: int = cli_field(
        1, "ranks (GPUs) one model is split across; ranks 1.. run as Ray actors", aliases=("-tp",)
    )
    enable_expert_parallel: bool = cli_field(
        False,
        "mixture-of-experts models: each of the --tensor-parallel-size ranks holds 1/K of the experts "
        "whole, instead of 1/K of every expert's width; attention stays tensor-parallel (ignored, with "
        "a log line, for dense models)",
    )
    # Per-request limits, enforced by the engine itself (the fronts import the same check).
    max_logprobs: int = cli_field(20, "most top logprobs one request may ask for per token")
    max_stop_strings: int = cli_field(64, "most stop strings one request may carry (each at most 1,024 characters)")
    max_n: int = cli_field(16, "most parallel samples (n, best_of) one request may ask for")
    max_logit_bias: int = cli_field(300, "most logit_bias entries one request may carry (OpenAI's limit)")
    grammar_compile_timeout_s: float = cli_field(
        10.0, "a structured-output grammar that takes longer to compile is refused (400), not left to block others"
    )
    structured_outputs_backend: str = cli_field(
        "guidance",
        "the grammar library of structured outputs: guidance (llguidance) or xgrammar (installed "
        "separately; `shoal bench structured` compares them)",
        choices=("guidance", "xgrammar"),
    )
    # LoRA adapters (vLLM's flags): requests for different adapters and for the base share a step.
    enable_lora: bool = cli_field(
        False, "serve LoRA adapters (peft's format) on the base model; a request names one (lora_request)"
    )
    lora_modules: list[str] | None = cli_field(
        None,
        'LoRA adapters served by name: name=path, or JSON {"name", "path", "base_model_name"}; '
        "repeatable. A request names one in its model field",
    )
    max_loras: int = cli_field(1, "adapters one step may use, each in a device slot")
    max_lora_rank: int = cli_field(16, "the largest adapter rank served (the slots are padded to it)")
    max_cpu_loras: int | None = cli_field(None, "adapters kept in host memory (default: --max-loras)")
    lora_root: str | None = cli_field(
        None,
        "runtime loads (/v1/load_lora_adapter) read adapters only from inside this folder (symlinks and .. "
        "resolved; a relative lora_path is taken under it); outside it is 403. Unset: any path the workers can read",
    )
    max_runtime_loras: int = cli_field(
        8, "adapters loaded at run time (/v1/load_lora_adapter) served at once; past it a load is 409"
    )
    lora_dtype: str = cli_field(
        "auto",
        "the adapters' slots: auto = --dtype; bfloat16 (or float16) under a float32 model keeps A and B in half "
        "the bytes a step reads, computed in float32",
        choices=("auto", *_DTYPES),
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_dataclass_args(parser, cls, "engine")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return dataclass_from_cli_args(cls, ns)

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """The model's compute dtype. On the CPU, bfloat16 where it is asked
        for (--dtype bfloat16, or bfloat16 weights under auto) and the CPU
        multiplies in bfloat16 (platforms/cpu/precision.py); else float32."""
        import torch

        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if device.type != "cpu":
            return torch.bfloat16 if self.dtype == "auto" else getattr(torch, self.dtype)
        if self.dtype == "bfloat16" or (self.dtype == "auto" and self.weight_dtype == "bfloat16"):
            from shoal.workers.model_executor.platforms.cpu.precision import cpu_bf16_compute

            return torch.bfloat16 if cpu_bf16_compute()[0] else torch.float32
        return torch.float32 if self.dtype == "auto" else getattr(torch, self.dtype)

    def resolved_lora_dtype(self, device: torch.device) -> torch.dtype:
        """The LoRA slots' storage dtype."""
        import torch

        if self.lora_dtype == "auto":
            return self.resolved_dtype(device)
        if self.lora_dtype not in _DTYPES:
            raise ValueError(f"lora_dtype must be one of auto, {', '.join(_DTYPES)}; got {self.lora_dtype!r}")
        return getattr(torch, self.lora_dtype)

    def resolved_weight_dtype(self, device: torch.device) -> torch.dtype:
        """The weight matrices' storage dtype (the compute dtype unless narrowed)."""
        dtype = self.resolved_dtype(device)
        import torch

        if self.weight_dtype == "auto" and self.dtype == "bfloat16" and dtype == torch.float32:
            return torch.bfloat16  # a CPU without bfloat16 arithmetic: stored as asked, computed in float32
        if self.weight_dtype == "auto" or (self.weight_dtype in _DTYPES and getattr(torch, self.weight_dtype) == dtype):
            return dtype
        if self.weight_dtype != "bfloat16":
            raise ValueError(f"weight_dtype must be auto or bfloat16; got {self.weight_dtype!r}")
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(
                "weight_dtype bfloat16 under a float32 model is a CPU option (its compiled kernels "
                f"widen the weights as they read them); got device {device.type}, dtype {dtype}"
            )
        return torch.bfloat16
