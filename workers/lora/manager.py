"""A rank's LoRA state (vLLM's LoRAModelManager): the model's seven
projections of every decoder layer wrapped with LoRA slots, the adapters
kept in host memory (LRU, max_cpu_loras), and each slot filled as the
scheduler's table says (SchedulerOutput.lora_slots) before the step runs.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
from torch import nn

from shoal.workers.lora.layers import LoRALinear
from shoal.workers.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from shoal.workers.lora.request import LoRARequest

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
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.load_seconds = 0.0  # reading adapters from disk and filling slots
        self.num_slot_fills = 0

    def host_ids(self) -> set[int]:
        """Ids of the adapters in host memory (a copy read from another thread)."""
        return set(list(self._host))

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from host memory, else read (and checked) from disk."""
        a = self._host.get(request.lora_int_id)
        if a is None:
            a = load_peft_adapter(request, self.model.config, self.max_lora_rank)
            self._host[request.lora_int_id] = a
            while len(self._host) > self.max_cpu_loras:
                evict = next((x for x in self._host if x not in self.slots and x != request.lora_int_id), None)
                if evict is None:
                    break
                del self._host[evict]
        self._host.move_to_end(request.lora_int_id)
        return a

    def set_active(self, slot_requests: dict[int, LoRARequest]) -> None:
        """Make each slot hold the adapter the scheduler put there."""
        for slot, request in slot_requests.items():
            if self.slots[slot] == request.lora_int_id:
                continue
            t0 = time.perf_counter()
            adapter = self.adapter(request)
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
