"""The CPU's counterpart of a CUDA graph: a decode step's decoder layers in
one C++ call (csrc/cpu_decode_layers.cpp), a DecodeStep (../interface.py).

At batch 1 the per-layer Python and op dispatch had been a third of a
float32 decode step on the CPU. The C++ layers are bound once to the
model's weights and KV cache and run the same kernels the layers do
(few-row matmul, norms, rotary, paged decode attention); Python sees the
embedding and one call, which ends with the final norm and the LM head
where the head is GGUF blocks (else Python runs those). The model runner
builds one where it applies (the cpu_kernel backend with AVX2, a float32
model on one rank whose decode plan (models/decode_plan.py) lists Llama's
layers only, every matmul's inner size a multiple of the kernel's 16) and
runs it for every step whose rows are all decodes, as it replays a CUDA
graph for those on CUDA. Where it does not apply while the kernels are
bound, the engine says why (why_not).

Under --quantization gguf a matrix held as Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or
Q6_K blocks goes to the C++ layers as its blocks and is multiplied there by
gguf_linear's or gguf_linear_k's own pieces (the same activation blocks and
tiles: the same bits as the per-layer path); a fused layer whose parts come
in different types (q and k in Q4_K, v in Q6_K, as a Q4_K_M file has them)
goes as its groups, one part each. A fused layer with a float part among
blocks keeps the model on the per-layer path.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelMetadata
from shoal.workers.model_executor.layers.attention.backends.torch_sdpa import DecodeGroup
from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from shoal.workers.model_executor.models.decode_plan import LLAMA, DecodePlan
from shoal.workers.model_executor.platforms.cpu.gguf_blocks import BLOCK_TYPES, F32, Q4_0, Q8_0
from shoal.workers.profiling import step_range

logger = logging.getLogger(__name__)
KINDS = (LLAMA,)  # the layers csrc/cpu_decode_layers.cpp computes
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _matrix(linear) -> tuple[list[torch.Tensor], list[int], int] | None:
    """(the parts the C++ layers read, their ggml types, F32 for float; input
    features) of a linear layer's weight, None where they cannot compute it."""
    method = type(linear.quant_method)
    if method is UnquantizedLinearMethod:
        return [linear.weight], [F32], linear.weight.shape[1]
    if method is GGUFLinearMethod:
        groups = linear.weight.gguf_groups
        if len(groups) == 1 and groups[0][0] == F32:  # float, kept so by the file
            return [groups[0][1]], [F32], groups[0][2]
        if all(t in BLOCK_TYPES and data.is_contiguous() for t, data, _ in groups):
            return [g[1] for g in groups], [g[0] for g in groups], groups[0][2]
    return None  # another quantized or wrapped method computes otherwise


def decode_plan_of(model: nn.Module) -> DecodePlan | None:
    """The model's decode plan, None where it offers none."""
    offer = getattr(model, "decode_plan", None)
    return None if offer is None else offer()


def why_not(model: nn.Module, plan: DecodePlan | None) -> str | None:
    """Why the C++ layers cannot run `model`'s decode steps over `plan`
    (its decode_plan()); None where they can."""
    if plan is None:
        return f"{type(model).__name__} offers no decode plan"
    kinds = sorted({layer.kind for layer in plan.layers} - set(KINDS))
    if kinds:
        return f"its decode plan has layers of kind {', '.join(kinds)}; the C++ layers compute {', '.join(KINDS)}"
    if model.dtype != torch.float32:
        return f"it computes in {model.dtype}; the C++ layers in float32"
    if plan.layers[0].down_proj.tp.size != 1:
        return "its layers are split across ranks; the C++ layers hold whole ones"
    rotary = plan.layers[0].rotary
    if any(layer.rotary is not rotary for layer in plan.layers) or rotary.rotary_dim != rotary.head_dim:
        return "its layers rotate by several tables or part of each head; the C++ layers by one, over whole heads"
    for i, layer in enumerate(plan.layers):
        for name in _LINEARS:
            linear = getattr(layer, name)
            m = _matrix(linear)
            if m is None:
                method = type(linear.quant_method).__name__
                return f"layer {i}'s {name}: {method} holds its weight in a form the C++ layers do not read"
            if m[1] == [F32] and m[2] % 16:
                return f"layer {i}'s {name} has {m[2]} input features, not a multiple of 16"
    return None


class CPUDecodeStep:
    model: Any  # an nn.Module with the model's own methods (get_input_embeddings, compute_logits)

    def __init__(self, model: nn.Module, plan: DecodePlan, kernels):
        self.model, self.plan, self.kernels = model, plan, kernels
        self._bound: Any = None  # (what it was built over, kernels.DecodeLayers, head in the call, _embedding's)

    @classmethod
    def create(cls, model: nn.Module, kernels) -> CPUDecodeStep | None:
        """One for `model` where the C++ layers can run it; kernels: what
        bind.py bound (None: the kernels are off or lack AVX2). Where they
        are bound but cannot run the model, logs why."""
        if kernels is None:
            return None
        plan = decode_plan_of(model)
        reason = why_not(model, plan)
        if reason is not None:
            # Layers planned as a kind the C++ layers do not compute are news (a warning); no plan, or a
            # setting they do not run (a dtype, tensor parallelism, a quantization method), is not.
            unknown = plan is not None and any(layer.kind not in KINDS for layer in plan.layers)
            (logger.warning if unknown else logger.info)(
                "decode steps run layer by layer, not in the one-call CPU decode step: %s", reason
            )
            return None
        return cls(model, cast(DecodePlan, plan), kernels)  # why_not says why where it is None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, meta: CPUKernelMetadata
    ) -> torch.Tensor:
        """The model's forward for a step whose rows are all decodes (meta.decode_only)."""
        g = cast(DecodeGroup, meta.decode)  # meta.decode_only
        layers = self.bound_layers()
        embed = self._bound[3]
        if embed is not None:  # the rows dequantized in one call, gguf.py's bits
            h = self.kernels.gguf_embedding(input_ids.reshape(-1), *embed)
        else:
            h = self.model.get_input_embeddings(input_ids)
        args = (h, positions, meta.slot_mapping, g.block_tables, g.context_lens)
        # The final norm and LM head in the same call where the head is GGUF
        # blocks, except while the layers time their ops (bench latency
        # --profile times the head through its module).
        if self._bound[2] and not layers.timing:
            with step_range("decoder_layers"):
                return layers.logits(*args, logits_indices)
        with step_range("decoder_layers"):
            h, residual = layers(*args)
        with step_range("compute_logits"):
            return self.model.compute_logits(h, residual, logits_indices)

    @property
    def head_in_call(self) -> bool:
        """Whether the final norm and the LM head run in the C++ call too."""
        self.bound_layers()
        return self._bound[2]

    @property
    def embedding_in_kernel(self) -> bool:
        """Whether the embedding's rows are looked up by gguf_embedding."""
        self.bound_layers()
        return self._bound[3] is not None

    def unbind(self) -> None:
        """Drops the C++ layers' hold on the KV cache (the runner frees or replaces it)."""
        self._bound = None

    def bound_layers(self):
        """The C++ layers bound to the model's weights and KV cache; built
        again when either is replaced (a new cache, weights cast on load)."""
        plan = self.plan
        l0 = plan.layers[0]
        heads = (plan.lm_head.weight.data_ptr(), plan.embed_tokens.weight.data_ptr())
        key = (self.kernels, l0.attn.k_cache.data_ptr(), l0.qkv_proj.weight.data_ptr(), heads)
        if self._bound is None or self._bound[0] != key:
            none = torch.empty(0)
            weights, types = [], []
            for layer in plan.layers:
                for w in (
                    layer.input_norm.weight,
                    layer.qkv_proj,
                    layer.qkv_proj.bias,
                    layer.o_proj,
                    layer.o_proj.bias,
                    layer.post_attention_norm.weight,
                    layer.gate_up_proj,
                    layer.gate_up_proj.bias,
                    layer.down_proj,
                    layer.down_proj.bias,
                ):
                    w, t, _ = _matrix(w) if isinstance(w, nn.Module) else ([w], [F32], 0)
                    weights.append([none if x is None else x for x in w])
                    types.append(t)
            layers = self.kernels.DecodeLayers(
                weights,
                [layer.attn.k_cache for layer in plan.layers],
                [layer.attn.v_cache for layer in plan.layers],
                l0.rotary.cos_cached,
                l0.rotary.sin_cached,
                l0.attn.num_heads,
                l0.attn.num_kv_heads,
                plan.rms_norm_eps,
                l0.attn.scale,
                [layer.attn.sliding_window or 0 for layer in plan.layers],  # 0: full attention
                types,  # each part's: F32 float, else GGUF blocks
            )
            head = _head(plan)
            if head is not None:
                layers.set_head(plan.norm.weight, *head)
            self._bound = (key, layers, head is not None, _embedding(plan))
        return self._bound[1]


def _embedding(plan: DecodePlan) -> tuple[torch.Tensor, int] | None:
    """(blocks, ggml type) of an embedding gguf_embedding can look up: Q8_0 or Q4_0 on one rank."""
    embed = plan.embed_tokens
    groups = getattr(embed.weight, "gguf_groups", None)
    if not isinstance(embed.quant_method, GGUFLinearMethod) or groups is None or len(groups) != 1:
        return None
    t, data, _ = groups[0]
    if t not in (Q4_0, Q8_0) or embed.tp.size != 1 or not data.is_contiguous():
        return None
    return data, t


def _head(plan: DecodePlan) -> tuple[torch.Tensor, int] | None:
    """(blocks, ggml type) of an LM head the C++ layers can finish the step
    with, as compute_logits would: blocks of one type on one rank,
    multiplied and normed by the compiled kernels."""
    head, norm = plan.lm_head, plan.norm
    groups = getattr(head.weight, "gguf_groups", None)
    if not isinstance(head.quant_method, GGUFLinearMethod) or groups is None or len(groups) != 1:
        return None
    t, data, _ = groups[0]
    if t not in BLOCK_TYPES or head.tp.size != 1 or head.cpu_kernels is None or norm.cpu_kernels is None:
        return None
    if getattr(norm, "use_fused", False) or not data.is_contiguous():
        return None
    return data, t
