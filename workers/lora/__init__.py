"""LoRA adapters on a shared base model: the request that names one, its
files' rules and the adapters' states live in the contract package
(proto/lora/); here, an adapter read from peft's format and checked against the
base model (peft_adapter.py), the checked adapters held in host memory
(host_cache.py), the grouped low-rank update that adds each row's adapter
to a linear layer's output (ops.py), the layers that hold the adapters'
slots (layers.py), a rank's manager of them (manager.py), and the adapters
a worker serves by name (worker_adapters.py). Which adapter sits in which
slot is the scheduler's (core/lora_slots.py)."""

from shoal.proto.lora.request import LoRARequest

__all__ = ["LoRARequest"]
