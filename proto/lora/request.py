"""vLLM's LoRARequest: which adapter a request runs under."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive id unique among the engine's adapters
    (0 is the base model), and the folder peft saved it to."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > 256:
            raise ValueError("lora_name must be a non-empty string of at most 256 characters")
        i = self.lora_int_id
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i < 2**63:
            raise ValueError(f"lora_int_id must be an integer in [1, 2**63) (0 is the base model); got {i!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError("lora_path must be a string")
