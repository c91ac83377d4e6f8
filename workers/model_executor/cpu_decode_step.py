"""The CPU's counterpart of a CUDA graph: a decode step's decoder layers in
one C++ call (layers/csrc/cpu_decode_layers.cpp).

At batch 1 the per-layer Python and op dispatch had been a third of a
float32 decode step on the CPU. The C++ layers are bound once to the
model's weights and KV cache and run the same kernels the layers do
(few-row matmul, norms, rotary, paged decode attention); Python sees the
embedding and one call, which ends with the final norm and the LM head
where the head is GGUF blocks (else Python runs those). The model runner
builds one where it applies (the cpu_kernel backend with AVX2, a float32
Llama-family model on one rank, every matmul's inner size a multiple of the
kernel's 16) and runs it for every step whose rows are all decodes, as it
replays a CUDA graph for those on CUDA.

Under --quantization gguf a matrix held as Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or
Q6_K blocks goes to the C++ layers as its blocks and is multiplied there by
gguf_linear's or gguf_linear_k's own pieces (the same activation blocks and
tiles: the same bits as the per-layer path); a fused layer whose parts come
in different types (q and k in Q4_K, v in Q6_K, as a Q4_K_M file has them)
goes as its groups, one part each. A fused layer with a float part among
blocks keeps the model on the per-layer path.
"""

from __future__ import annotations

import torch

from shoal.workers.model_executor.layers.attention.backends.cpu_kernel import CPUKernelMetadata
from shoal.workers.model_executor.layers.quantization.gguf import GGUFLinearMethod
from shoal.workers.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from shoal.workers.model_executor.models.llama import LlamaForCausalLM
from shoal.workers.profiling import step_range

_BLOCK_TYPES = (2, 3, 8, 12, 13, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K


def _matrix(linear) -> tuple[list[torch.Tensor], list[int], int] | None:
    """(the parts the C++ layers read, their ggml types, 0 for float; input
    features) of a linear layer's weight, None where they cannot compute it."""
    method = type(linear.quant_method)
    if method is UnquantizedLinearMethod:
        return [linear.weight], [0], linear.weight.shape[1]
    if method is GGUFLinearMethod:
        groups = linear.weight.gguf_groups
        if len(groups) == 1 and groups[0][0] == 0:  # float, kept so by the file
            return [groups[0][1]], [0], groups[0][2]
        if all(t in _BLOCK_TYPES and data.is_contiguous() for t, data, _ in groups):
            return [g[1] for g in groups], [g[0] for g in groups], groups[0][2]
    return None  # another quantized or wrapped method computes otherwise


class CPUDecodeStep:
    def __init__(self, model: LlamaForCausalLM, kernels):
        self.model, self.kernels = model, kernels
        self._bound = None  # (what it was built over, kernels.DecodeLayers)

    @classmethod
    def create(cls, model: torch.nn.Module, kernels) -> CPUDecodeStep | None:
        """One for `model` where the C++ layers can run it; kernels: what
        layers/cpu_kernels.bind returned (None without AVX2)."""
        # The C++ layers are the Llama family's own (a subclass changes the layers).
        if kernels is None or type(model) is not LlamaForCausalLM or model.dtype != torch.float32:
            return None
        if model.layers[0].mlp.down_proj.tp.size != 1:
            return None
        linears = [x for layer in model.layers for x in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
        linears += [x for layer in model.layers for x in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        matrices = [_matrix(x) for x in linears]
        if any(m is None or (m[1] == [0] and m[2] % 16) for m in matrices):
            return None
        return cls(model, kernels)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, meta: CPUKernelMetadata
    ) -> torch.Tensor:
        """The model's forward for a step whose rows are all decodes (meta.decode_only)."""
        g = meta.decode
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
        model = self.model
        a0 = model.layers[0].self_attn
        heads = (model.lm_head.weight.data_ptr(), model.embed_tokens.weight.data_ptr())
        key = (self.kernels, a0.attn.k_cache.data_ptr(), a0.qkv_proj.weight.data_ptr(), heads)
        if self._bound is None or self._bound[0] != key:
            none = torch.empty(0)
            weights, types, k_caches, v_caches = [], [], [], []
            for layer in model.layers:
                a, m = layer.self_attn, layer.mlp
                for w in (
                    layer.input_layernorm.weight,
                    a.qkv_proj,
                    a.qkv_proj.bias,
                    a.o_proj,
                    a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    m.gate_up_proj,
                    m.gate_up_proj.bias,
                    m.down_proj,
                    m.down_proj.bias,
                ):
                    w, t, _ = _matrix(w) if isinstance(w, torch.nn.Module) else ([w], [0], 0)
                    weights.append([none if x is None else x for x in w])
                    types.append(t)
                k_caches.append(a.attn.k_cache)
                v_caches.append(a.attn.v_cache)
            layers = self.kernels.DecodeLayers(
                weights,
                k_caches,
                v_caches,
                a0.rotary.cos_cached,
                a0.rotary.sin_cached,
                a0.num_heads,
                a0.num_kv_heads,
                model.config.rms_norm_eps,
                a0.attn.scale,
                [layer.self_attn.attn.sliding_window or 0 for layer in model.layers],  # 0: full attention
                types,  # each part's: 0 float, else GGUF blocks
            )
            head = _head(model)
            if head is not None:
                layers.set_head(model.norm.weight, *head)
            self._bound = (key, layers, head is not None, _embedding(model))
        return self._bound[1]


def _embedding(model: LlamaForCausalLM) -> tuple[torch.Tensor, int] | None:
    """(blocks, ggml type) of an embedding gguf_embedding can look up: Q8_0 or Q4_0 on one rank."""
    embed = model.embed_tokens
    groups = getattr(embed.weight, "gguf_groups", None)
    if not isinstance(embed.quant_method, GGUFLinearMethod) or groups is None or len(groups) != 1:
        return None
    t, data, _ = groups[0]
    if t not in (2, 8) or embed.tp.size != 1 or not data.is_contiguous():
        return None
    return data, t


def _head(model: LlamaForCausalLM) -> tuple[torch.Tensor, int] | None:
    """(blocks, ggml type) of an LM head the C++ layers can finish the step
    with, as compute_logits would: blocks of one type on one rank,
    multiplied and normed by the compiled kernels."""
    head, norm = model.lm_head, model.norm
    groups = getattr(head.weight, "gguf_groups", None)
    if not isinstance(head.quant_method, GGUFLinearMethod) or groups is None or len(groups) != 1:
        return None
    t, data, _ = groups[0]
    if t not in _BLOCK_TYPES or head.tp.size != 1 or head.cpu_kernels is None or norm.cpu_kernels is None:
        return None
    if getattr(norm, "use_fused", False) or not data.is_contiguous():
        return None
    return data, t
