"""A rank's LoRA state (vLLM's LoRAModelManager): the model's seven
projections of every decoder layer wrapped with LoRA slots, the adapters
kept in host memory (host_cache.py, max_cpu_loras: on rank 0, where the
engine puts each adapter it has read and checked), and each slot filled as
the scheduler's table says (SchedulerOutput.lora_slots) before the step
runs. A slot is filled only from held tensors, never from disk: rank 0 from
its host cache, the other tensor-parallel ranks from the adapters rank 0
sends with the step (adapters_to_send). A fill that fails leaves its slot
empty, so the step's failure isolation (LLMEngine._blame, whose probes
carry the slots) pins the failure on that adapter's requests alone.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from shoal.proto.lora.request import LoRARequest
from shoal.workers.fault_injection import FaultPlan
from shoal.workers.lora.host_cache import LoRAHostCache
from shoal.workers.lora.layers import LoRALinear
from shoal.workers.lora.peft_adapter import LoRAAdapter

logger = logging.getLogger(__name__)

# (attribute path in a decoder layer, the checkpoint modules of its parts)
TARGETS = (
    (("self_attn", "qkv_proj"), ("q_proj", "k_proj", "v_proj")),
    (("self_attn", "o_proj"), ("o_proj",)),
    (("mlp", "gate_up_proj"), ("gate_proj", "up_proj")),
    (("mlp", "down_proj"), ("down_proj",)),
)


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.layers: list[dict[str, LoRALinear]] = []  # per decoder layer: module name -> its wrapper
        for layer in model.layers:
            wrapped = {}
            for (parent_name, child), modules in TARGETS:
                parent = getattr(layer, parent_name)
                base = getattr(parent, child, None)
                if base is None:  # a mixture of experts' MLP: its experts take no adapter
                    continue
                w = LoRALinear(base, modules, max_loras, max_lora_rank, self.scalings, dtype)
                setattr(parent, child, w)
                wrapped.update({m: w for m in modules})
            self.layers.append(wrapped)
        self.slots: list[int | None] = [None] * max_loras  # the adapter id in each slot
        self.host = LoRAHostCache(self.max_cpu_loras)
        self.fault_plan = FaultPlan.from_env()  # None unless a test asks for faults
        self.load_seconds = 0.0  # filling slots
        self.num_slot_fills = 0

    def host_ids(self) -> set[int]:
        """Ids of the adapters in host memory (a copy read from another thread)."""
        return self.host.ids()

    def slot_ids(self) -> set[int]:
        return {aid for aid in list(self.slots) if aid is not None}

    def adapters_to_send(self, slot_requests: dict[int, LoRARequest]) -> dict[int, LoRAAdapter]:
        """Rank 0, before a tensor-parallel step: the held adapters of the
        slots the step changes, for the other ranks (whose slots hold what
        this rank's do, step after step)."""
        out = {}
        for slot, request in slot_requests.items():
            if self.slots[slot] != request.lora_int_id:
                adapter = self.host.get(request.lora_int_id)
                if adapter is not None:
                    out[slot] = adapter
        return out

    def set_active(self, slot_requests: dict[int, LoRARequest], sent: dict[int, LoRAAdapter] | None = None) -> None:
        """Make each slot hold the adapter the scheduler put there, from host
        memory (or `sent`: what rank 0 sent with the step)."""
        for slot, request in slot_requests.items():
            if self.slots[slot] == request.lora_int_id:
                continue
            t0 = time.perf_counter()
            adapter = (sent or {}).get(slot) or self.host.get(request.lora_int_id)
            if adapter is None or adapter.int_id != request.lora_int_id:
                raise RuntimeError(f"LoRA adapter {request.lora_name!r} is not in host memory")
            self.slots[slot] = None  # until filled: a fill that fails half way leaves no slot claiming it
            if self.fault_plan is not None:  # tests only (workers/fault_injection.py)
                self.fault_plan.before_slot_fill(request)
            by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            for (layer, module), ab in adapter.weights.items():
                by_layer.setdefault(layer, {})[module] = ab
            for i, wrapped in enumerate(self.layers):
                for w in set(wrapped.values()):
                    w.set_slot(slot, by_layer.get(i))
            self.scalings[slot] = adapter.scaling
            self.slots[slot] = request.lora_int_id
            self.num_slot_fills += 1
            self.load_seconds += time.perf_counter() - t0
            logger.info("LoRA adapter %r in slot %d", request.lora_name, slot)
