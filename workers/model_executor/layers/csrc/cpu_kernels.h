// The CPU kernels' entry points, for the bindings and for kernels that
// compose them (cpu_decode_layers.cpp).
#pragma once
#include <torch/extension.h>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);

// Every decoder layer of a Llama-family model for a step of decodes
// (cpu_decode_layers.cpp). Built once per model and KV cache: the 10
// tensors of each layer (an absent bias is an empty tensor) and its caches.
struct DecodeLayers {
  DecodeLayers(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
               std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
               int64_t num_kv_heads, double eps, double scale);
  std::vector<torch::Tensor> forward(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                     torch::Tensor block_tables, torch::Tensor context_lens);

  std::vector<torch::Tensor> weights, k_caches, v_caches;
  torch::Tensor cos, sin;
  int64_t num_heads, num_kv_heads;
  double eps, scale;
};
