// Every decoder layer of a Llama-family model for a step in which each
// sequence brings one token, in one call from Python.
//
// At batch 1 a step is 30 layers of a dozen small ops; through eager
// torch each op costs its dispatch and each layer its Python, which
// together came to a third of the step on a 2-core CPU. Here the layers
// run back to back in C++ over the same kernels the modules call one by
// one (so the math is theirs), inside one parallel region: each op's work
// is split across the threads, which meet at a barrier between ops instead
// of being woken for every matmul. The weights and cache are bound once.
// Under GGUF the region can end with the final norm and the LM head
// (logits): the largest matrix of a small model, and a dozen torch ops less.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <immintrin.h>

const char* const DecodeLayers::kOpNames[DecodeLayers::kOps] = {
    "input norm", "qkv_proj", "RoPE and KV write", "attention", "o_proj",
    "post-attention norm", "gate_up_proj", "SiLU and mul", "down_proj"};

namespace {
// One layer's tensors, in the order LlamaForCausalLM._bound_decode_layers lists them.
constexpr size_t kPerLayer = 10;

const float* data_or_null(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// This thread's share [begin, end) of n items, in whole multiples of `align`.
void share(int64_t n, int64_t align, int tid, int nt, int64_t& begin, int64_t& end) {
  const int64_t units = (n + align - 1) / align, per = (units + nt - 1) / nt;
  begin = std::min(n, tid * per * align);
  end = std::min(n, (tid + 1) * per * align);
}
}  // namespace

DecodeLayers::DecodeLayers(std::vector<torch::Tensor> weights_, std::vector<torch::Tensor> k_caches_,
                           std::vector<torch::Tensor> v_caches_, torch::Tensor cos_, torch::Tensor sin_,
                           int64_t num_heads_, int64_t num_kv_heads_, double eps_, double scale_,
                           std::vector<int64_t> windows_, std::vector<int64_t> types_)
    : weights(std::move(weights_)), k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)),
      windows(std::move(windows_)), types(std::move(types_)), cos(std::move(cos_)), sin(std::move(sin_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_), eps(eps_),
      scale(scale_) {
#ifndef __AVX2__
  TORCH_CHECK(false, "DecodeLayers: built without AVX2");
#endif
  TORCH_CHECK(!k_caches.empty() && weights.size() == k_caches.size() * kPerLayer &&
                  v_caches.size() == k_caches.size() && windows.size() == k_caches.size(),
              "DecodeLayers: ", kPerLayer, " tensors per layer, one cache and one window each");
  for (int64_t w : windows) TORCH_CHECK(w >= 0, "DecodeLayers: sliding windows >= 0 (0: none)");
  if (types.empty()) types.assign(weights.size(), 0);
  TORCH_CHECK(types.size() == weights.size(), "DecodeLayers: one type per tensor");
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const bool matrix = i % kPerLayer == 1 || i % kPerLayer == 3 || i % kPerLayer == 6 || i % kPerLayer == 8;
    TORCH_CHECK(matrix || types[i] == 0, "DecodeLayers: only weight matrices come as GGUF blocks");
    if (types[i] != 0) {
      const int64_t bb = gguf_weight_block_bytes(types[i]);
      TORCH_CHECK(bb > 0, "DecodeLayers: GGUF blocks of ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), not ", types[i]);
      TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kUInt8 && w.size(1) % bb == 0,
                  "DecodeLayers: GGUF weight matrices contiguous uint8 [rows, whole blocks]");
    } else if (matrix) {
      TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0 &&
                      (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
                  "DecodeLayers: weight matrices contiguous, float32 or bfloat16, inner size a multiple of 16");
    } else {
      TORCH_CHECK(w.numel() == 0 || (w.is_contiguous() && w.scalar_type() == torch::kFloat32),
                  "DecodeLayers: norms and biases contiguous float32");
    }
  }
  for (size_t l = 0; l < k_caches.size(); ++l)
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == torch::kFloat32, "DecodeLayers: contiguous float32 caches");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  cos.size(1) == k_caches[0].size(3), "DecodeLayers: float32 rotary tables [max_pos, head_dim]");
}

int64_t DecodeLayers::cols(size_t i) const {
  const auto& w = weights[i];
  return types[i] ? w.size(1) / gguf_weight_block_bytes(types[i]) * 32 : w.size(1);
}

void DecodeLayers::set_head(torch::Tensor norm_weight, torch::Tensor head_blocks, int64_t head_type_) {
  const int64_t hidden = weights[0].numel();
  const int64_t bb = gguf_weight_block_bytes(head_type_);
  TORCH_CHECK(bb > 0, "set_head: GGUF blocks of ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), not ", head_type_);
  TORCH_CHECK(norm_weight.is_contiguous() && norm_weight.scalar_type() == torch::kFloat32 &&
                  norm_weight.numel() == hidden, "set_head: a float32 norm weight of the hidden size");
  TORCH_CHECK(head_blocks.dim() == 2 && head_blocks.is_contiguous() && head_blocks.scalar_type() == torch::kUInt8 &&
                  head_blocks.size(1) == hidden / 32 * bb && hidden % 32 == 0,
              "set_head: LM head contiguous uint8 [rows, hidden / 32 blocks]");
  head_norm = std::move(norm_weight);
  head = std::move(head_blocks);
  head_type = head_type_;
}

// h: [T, hidden] embeddings -> {mlp output, residual} of the last layer (the
// model's final norm adds them, as after any layer).
std::vector<torch::Tensor> DecodeLayers::forward(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                                 torch::Tensor block_tables, torch::Tensor context_lens) {
  return run(h, positions, slot_mapping, block_tables, context_lens, nullptr);
}

// The same, then the final norm (of the two added) and the LM head at
// logits_indices' rows: the model's compute_logits, its bits (the norm's
// kernel, gguf_linear's pieces), without a return to Python.
torch::Tensor DecodeLayers::logits(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                   torch::Tensor block_tables, torch::Tensor context_lens,
                                   torch::Tensor logits_indices) {
  TORCH_CHECK(head.defined(), "decode_layers.logits: no head (set_head)");
  TORCH_CHECK(logits_indices.dim() == 1 && logits_indices.scalar_type() == torch::kInt64,
              "decode_layers.logits: int64 logits_indices");
  return run(h, positions, slot_mapping, block_tables, context_lens, &logits_indices)[0];
}

std::vector<torch::Tensor> DecodeLayers::run(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                             torch::Tensor block_tables, torch::Tensor context_lens,
                                             const torch::Tensor* li) {
  TORCH_CHECK(h.scalar_type() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(), "decode_layers: float32 h");
  const int64_t T = h.size(0), hidden = h.size(1);
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T && block_tables.size(0) == T &&
                  context_lens.numel() == T && positions.scalar_type() == torch::kInt64 &&
                  slot_mapping.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 &&
                  context_lens.scalar_type() == torch::kInt64, "decode_layers: T int64 positions, slots, tables, lengths");
  // Nothing may throw inside the parallel region: every index is checked here.
  auto pos_t = positions.contiguous(), slots_t = slot_mapping.contiguous();
  auto tables_t = block_tables.contiguous(), lens_t = context_lens.contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  const int64_t num_slots = k_caches[0].size(0) * k_caches[0].size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0) && slots[t] >= 0 && slots[t] < num_slots,
                "decode_layers: position or cache slot out of range");
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const int64_t D = k_caches[0].size(3), bs = k_caches[0].size(1);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
  const int64_t G = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t inter = cols(8);
  TORCH_CHECK(weights[1].size(0) == qkv_size && cols(1) == hidden && cols(3) == q_size &&
                  weights[6].size(0) == 2 * inter, "decode_layers: weights of another model shape");
  auto opts = h.options();
  torch::Tensor residual = h;  // h is this step's own embeddings: the sum may start in it
  auto x = torch::empty({T, hidden}, opts), qkv = torch::empty({T, qkv_size}, opts);
  auto attn = torch::empty({T, q_size}, opts), gate_up = torch::empty({T, 2 * inter}, opts);
  auto act = torch::empty({T, inter}, opts);
  auto interleaved = torch::empty({T, std::max({hidden, q_size, inter})}, opts);
  float *rp = residual.data_ptr<float>(), *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *ap = attn.data_ptr<float>(), *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  float* ip = interleaved.data_ptr<float>();
  // A GGUF linear's input rows as 8-bit activation blocks (36 bytes a block at most).
  auto xq = torch::empty({T * std::max({hidden, q_size, inter}) / 32 * 36}, opts.dtype(torch::kUInt8));
  uint8_t* xqp = xq.data_ptr<uint8_t>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // The head's rows (logits only): checked here, outside the parallel region.
  torch::Tensor li_t, normed, logits;
  const int64_t* lip = nullptr;
  int64_t R = 0, V = 0;
  float *np = nullptr, *lp = nullptr;
  if (li != nullptr) {
    li_t = li->contiguous();
    lip = li_t.data_ptr<int64_t>();
    R = li_t.numel();
    for (int64_t i = 0; i < R; ++i) TORCH_CHECK(lip[i] >= 0 && lip[i] < T, "decode_layers: logits index out of range");
    V = head.size(0);
    normed = torch::empty({R, hidden}, opts);
    logits = torch::empty({R, V}, opts);
    np = normed.data_ptr<float>();
    lp = logits.data_ptr<float>();
  }
  PagedAttn pa{qkvp, qkv_size, ap, q_size, nullptr, nullptr, tables_t.data_ptr<int64_t>(), tables_t.size(1),
               lens_t.data_ptr<int64_t>(), num_heads, num_kv_heads, D, bs, static_cast<float>(scale), 0};

#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    using clock = std::chrono::steady_clock;
    const bool timed = timing && tid == 0;
    auto last = clock::now();
    auto mark = [&](int op) {  // after a barrier: op ran from the last mark to here
      if (!timed) return;
      const auto now = clock::now();
      op_seconds[op] += std::chrono::duration<double>(now - last).count();
      last = now;
    };
    int64_t r0, r1;  // this thread's rows of the step
    share(T, 1, tid, nt, r0, r1);
    std::vector<float> scores, acc;
    // y = in w^T + b over this thread's weight rows; in's rows are K wide.
    // GGUF blocks (type != 0): in's rows quantized once into xqp, split by
    // rows (quantized: already done by the op that wrote them, which saves a
    // barrier), then the tiles over this thread's weight rows, as gguf_linear
    // and then + b.
    auto linear = [&](const float* in, int64_t K, const torch::Tensor& w, const torch::Tensor& b, int64_t type,
                      float* y, bool quantized) {
      int64_t n0, n1;
      const int64_t N = w.size(0);
      share(N, type != 0 ? 16 : 4, tid, nt, n0, n1);  // GGUF: whole packed groups
      if (type != 0) {
        if (!quantized) {
          gguf_quantize_rows(in, xqp, K, type, r0, r1);
#pragma omp barrier
        }
        gguf_linear_rows(xqp, w.data_ptr<uint8_t>(), type, y, T, N, K, n0, n1);
        if (const float* bp = data_or_null(b))
          for (int64_t t = 0; t < T; ++t)
            for (int64_t n = n0; n < n1; ++n) y[t * N + n] += bp[n];
#pragma omp barrier
        return;
      }
      if (w.scalar_type() == torch::kBFloat16) {
        for (int64_t t = r0; t < r1; ++t) interleave_for_bf16(in + t * K, ip + t * K, K);
        in = ip;
#pragma omp barrier
      }
      linear_rows(in, w, data_or_null(b), y, T, n0, n1);
#pragma omp barrier
    };
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* w = weights.data() + l * kPerLayer;
      const int64_t* ty = types.data() + l * kPerLayer;
      const float* in_norm = w[0].data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t) {
        float* r = rp + t * hidden;
        float* xr = xp + t * hidden;
        if (l > 0)  // the first layer's norm has no pending output to add (see LlamaDecoderLayer)
          for (int64_t j = 0; j < hidden; ++j) r[j] += xr[j];
        norm_row(r, in_norm, xr, hidden, e);
        if (ty[1]) gguf_quantize_rows(xp, xqp, hidden, ty[1], t, t + 1);
      }
#pragma omp barrier
      mark(0);
      linear(xp, hidden, w[1], w[2], ty[1], qkvp, true);
      mark(1);
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t) {
        float* row = qkvp + t * qkv_size;
        rotate(row, num_heads, D, cp + pos[t] * D, sp + pos[t] * D, D);
        rotate(row + q_size, num_kv_heads, D, cp + pos[t] * D, sp + pos[t] * D, D);
        std::memcpy(kc + slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
        std::memcpy(vc + slots[t] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
      }
#pragma omp barrier
      mark(2);
      pa.k_cache = kc;
      pa.v_cache = vc;
      pa.window = windows[l];
      // Shared out by query head, not by KV head: at batch 1 SmolLM2's 3 KV
      // heads left one of 2 threads twice the other's work; a thread's run of
      // heads in one KV group still reads that group's keys and values once.
      int64_t j0, j1;
      share(T * num_heads, 1, tid, nt, j0, j1);
      for (int64_t j = j0; j < j1;) {
        const int64_t g0 = j % G, g1 = std::min(G, g0 + j1 - j);
        attend_job(pa, j / G, scores, acc, g0, g1);
        j += g1 - g0;
      }
#pragma omp barrier
      mark(3);
      linear(ap, q_size, w[3], w[4], ty[3], xp, false);  // attention's rows are split by head
      mark(4);
      const float* post_norm = w[5].data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t) {
        float* r = rp + t * hidden;
        float* xr = xp + t * hidden;
        for (int64_t j = 0; j < hidden; ++j) r[j] += xr[j];
        norm_row(r, post_norm, xr, hidden, e);
        if (ty[6]) gguf_quantize_rows(xp, xqp, hidden, ty[6], t, t + 1);
      }
#pragma omp barrier
      mark(5);
      linear(xp, hidden, w[6], w[7], ty[6], gup, true);
      mark(6);
      for (int64_t t = r0; t < r1; ++t) {
        silu_mul_row(gup + t * 2 * inter, actp + t * inter, inter);
        if (ty[8]) gguf_quantize_rows(actp, xqp, inter, ty[8], t, t + 1);
      }
#pragma omp barrier
      mark(7);
      linear(actp, inter, w[8], w[9], ty[8], xp, true);
      mark(8);
    }
    if (lip != nullptr) {
      // compute_logits: norm(residual + x) at each index's row, as rms_norm
      // does it (the sum in place, then norm_row), into a row of its own.
      int64_t i0, i1;
      share(R, 1, tid, nt, i0, i1);
      const float* fw = head_norm.data_ptr<float>();
      for (int64_t i = i0; i < i1; ++i) {
        float* s = np + i * hidden;
        const float *r = rp + lip[i] * hidden, *xr = xp + lip[i] * hidden;
        for (int64_t j = 0; j < hidden; ++j) s[j] = r[j] + xr[j];
        norm_row(s, fw, s, hidden, e);
        gguf_quantize_rows(np, xqp, hidden, head_type, i, i + 1);
      }
#pragma omp barrier
      int64_t n0, n1;
      share(V, 16, tid, nt, n0, n1);
      gguf_linear_rows(xqp, head.data_ptr<uint8_t>(), head_type, lp, R, V, hidden, n0, n1);
    }
  }
  if (lip != nullptr) return {logits};
  return {x, residual};
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0, "argmax_rows: float32 [rows, n > 0]");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), n = xc.size(1);
  auto out = torch::empty({M}, xc.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const float* v = xc.data_ptr<float>() + m * n;
    // One pass for the maximum and any NaN, then the first index that holds it.
    float best = v[0];
    bool nan = std::isnan(v[0]);
    int64_t i = 1;
#ifdef __AVX2__
    if (n >= 16) {
      __m256 mx = _mm256_loadu_ps(v), un = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
      for (i = 8; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(v + i);
        mx = _mm256_max_ps(mx, a);
        un = _mm256_or_ps(un, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, mx);
      for (float l : lanes) best = std::max(best, l);
      nan = nan || _mm256_movemask_ps(un) != 0;
    }
#endif
    for (; i < n; ++i) {
      nan = nan || std::isnan(v[i]);
      best = std::max(best, v[i]);
    }
    int64_t at = 0;
    if (nan) {
      while (!std::isnan(v[at])) ++at;
    } else {
      while (v[at] != best) ++at;
    }
    op[m] = at;
  }
  return out;
}
