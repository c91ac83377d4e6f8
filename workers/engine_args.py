"""Engine arguments, named as in vLLM where vLLM has the knob."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None = the default model
    dtype: str = "auto"  # float32, bfloat16, float16; auto = float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # cpu, cuda, cuda:N; auto = cuda when available
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int | None = None  # KV budget in bytes (default 2 GiB on CPU, 90% free on GPU)
    num_kv_blocks: int | None = None  # KV budget in blocks (wins over bytes)
    max_model_len: int | None = None  # prompt + output cap; default: the model's context length
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    seed: int = 0  # seeds the generators of requests that bring no seed
    num_threads: int | None = None  # torch CPU threads; default: all cores
    # auto: the compiled CPU decode kernel on CPU/float32 when it builds, else
    # torch; "torch" forces the pure-torch reference backend.
    attention_backend: str = "auto"
    # Ranks (GPUs) one model is split across; ranks 1.. run as Ray actors.
    tensor_parallel_size: int = 1

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {self.dtype!r}")
        return names[self.dtype]
