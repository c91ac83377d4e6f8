// Every decoder layer of a Llama-family model for a step in which each
// sequence brings one token, in one call from Python.
//
// At batch 1 a step is 30 layers of a dozen small ops; through eager
// torch each op costs its dispatch and each layer its Python, which
// together came to a third of the step on a 2-core CPU. Here the layers
// run back to back in C++ over the same kernels the modules call one by
// one (so the math is theirs), and Python sees one call per step (the weights and caches are bound once).
#include "cpu_kernels.h"

#include <cstring>

namespace {
// One layer's tensors, in the order LlamaForCausalLM._build_decode_layers lists them.
constexpr size_t kPerLayer = 10;

c10::optional<torch::Tensor> bias_or_none(const torch::Tensor& b) {
  return b.numel() ? c10::optional<torch::Tensor>(b) : c10::nullopt;
}

// Rows t of k/v [T, KVH * D] go to flat slot slots[t] of the cache [blocks, block_size, KVH, D].
void write_cache(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 const int64_t* slots, int64_t T) {
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slots[t] * row, k.data_ptr<float>() + t * k.stride(0), row * sizeof(float));
    std::memcpy(vc + slots[t] * row, v.data_ptr<float>() + t * v.stride(0), row * sizeof(float));
  }
}
}  // namespace

DecodeLayers::DecodeLayers(std::vector<torch::Tensor> weights_, std::vector<torch::Tensor> k_caches_,
                           std::vector<torch::Tensor> v_caches_, torch::Tensor cos_, torch::Tensor sin_,
                           int64_t num_heads_, int64_t num_kv_heads_, double eps_, double scale_)
    : weights(std::move(weights_)), k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)),
      cos(std::move(cos_)), sin(std::move(sin_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_), eps(eps_),
      scale(scale_) {
  TORCH_CHECK(weights.size() == k_caches.size() * kPerLayer && v_caches.size() == k_caches.size(),
              "DecodeLayers: ", kPerLayer, " tensors per layer and one cache each");
}

// h: [T, hidden] embeddings -> {mlp output, residual} of the last layer (the
// model's final norm adds them, as after any layer).
std::vector<torch::Tensor> DecodeLayers::forward(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                                 torch::Tensor block_tables, torch::Tensor context_lens) {
  TORCH_CHECK(h.scalar_type() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(), "decode_layers: float32 h");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "decode_layers: int64 slot mapping");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const int64_t T = h.size(0);
  const int64_t D = k_caches[0].size(3);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  torch::Tensor residual = h, x;  // h is this step's own embeddings: the sum may start in it
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + l * kPerLayer;
    // The first layer's norm has no pending output to add (see LlamaDecoderLayer).
    x = l == 0 ? rms_norm(residual, c10::nullopt, w[0], eps) : rms_norm(x, residual, w[0], eps);
    auto qkv = small_m_linear(x, w[1], bias_or_none(w[2]));
    auto q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
    auto k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_embedding(positions, q, k, cos, sin);
    write_cache(k.view({T, kv_size}), v, k_caches[l], v_caches[l], slots, T);
    auto attn = paged_decode_attention(q, k_caches[l], v_caches[l], block_tables, context_lens, scale);
    x = small_m_linear(attn.view({T, q_size}), w[3], bias_or_none(w[4]));
    x = rms_norm(x, residual, w[5], eps);
    x = small_m_linear(silu_and_mul(small_m_linear(x, w[6], bias_or_none(w[7]))), w[8], bias_or_none(w[9]));
  }
  return {x, residual};
}
