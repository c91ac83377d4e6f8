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

bool is_matrix(size_t i) {
  const size_t j = i % kPerLayer;
  return j == 1 || j == 3 || j == 6 || j == 8;
}

const float* data_or_null(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// This thread's share [begin, end) of n items, in whole multiples of `align`.
void share(int64_t n, int64_t align, int tid, int nt, int64_t& begin, int64_t& end) {
  const int64_t units = (n + align - 1) / align, per = (units + nt - 1) / nt;
  begin = std::min(n, tid * per * align);
  end = std::min(n, (tid + 1) * per * align);
}

// GGUF blocks of either kernel: the 32-value types (gguf_gemv.cpp) or the
// K-quants' super-blocks of 256 (gguf_kquants.cpp).
bool is_k(int64_t type) { return gguf_k_block_bytes(type) > 0; }
int64_t block_bytes(int64_t type) { return is_k(type) ? gguf_k_block_bytes(type) : gguf_weight_block_bytes(type); }
int64_t block_values(int64_t type) { return is_k(type) ? 256 : 32; }

// The activation blocks a type multiplies: block_q8_0 (Q4_0, Q8_0),
// block_q8_1 (Q4_1) or block_q8_K; a fused layer in two kinds quantizes its
// input once for each.
constexpr int kActKinds = 3;
int act_kind(int64_t type) { return is_k(type) ? 2 : type == 3 ? 1 : 0; }
constexpr int64_t kKindType[kActKinds] = {8, 3, 12};  // a type of each kind
// Activation bytes per input value, at most: 37 / 32 > 292 / 256 and 36 / 32.
int64_t act_bytes(int64_t T, int64_t K) { return T * (K / 32 + 1) * 37; }

void quantize_kind(int kind, const float* x, uint8_t* out, int64_t K, int64_t m0, int64_t m1) {
  if (kind == 2)
    gguf_k_quantize_rows(x, out, K, m0, m1);
  else
    gguf_quantize_rows(x, out, K, kKindType[kind], m0, m1);
}

// Rows [n0, n1) of a part into y (row stride ldy; the part's own columns).
void multiply(const DecodeLayers::Part& p, const uint8_t* xq, float* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
              int64_t n1) {
  const uint8_t* w = p.w.data_ptr<uint8_t>();
  if (is_k(p.type))
    gguf_k_linear_rows(xq, w, p.type, y, ldy, M, K, n0, n1);
  else
    gguf_linear_rows(xq, w, p.type, y, ldy, M, p.rows, K, n0, n1);
}

// A tensor's parts, checked: a matrix in float (one part) or in GGUF blocks
// of one input size; anything else one float part.
std::vector<DecodeLayers::Part> make_parts(size_t i, std::vector<torch::Tensor> ws, const std::vector<int64_t>& ts) {
  TORCH_CHECK(!ws.empty() && ws.size() == ts.size(), "DecodeLayers: each tensor one or more parts, a type each");
  std::vector<DecodeLayers::Part> out;
  int64_t offset = 0, cols = -1;
  for (size_t j = 0; j < ws.size(); ++j) {
    const torch::Tensor& w = ws[j];
    const int64_t t = ts[j];
    if (t == 0) {
      TORCH_CHECK(ws.size() == 1, "DecodeLayers: a float tensor comes in one part");
      if (is_matrix(i)) {
        TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) % 16 == 0 &&
                        (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
                    "DecodeLayers: weight matrices contiguous, float32 or bfloat16, inner size a multiple of 16");
      } else {
        TORCH_CHECK(w.numel() == 0 || (w.is_contiguous() && w.scalar_type() == torch::kFloat32),
                    "DecodeLayers: norms and biases contiguous float32");
      }
      out.push_back({w, 0, w.dim() == 2 ? w.size(0) : 0, 0});
      continue;
    }
    TORCH_CHECK(is_matrix(i), "DecodeLayers: only weight matrices come as GGUF blocks");
    const int64_t bb = block_bytes(t);
    TORCH_CHECK(bb > 0, "DecodeLayers: GGUF blocks of ggml_type 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K)",
                " or 14 (Q6_K), not ", t);
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kUInt8 && w.size(1) % bb == 0,
                "DecodeLayers: GGUF weight matrices contiguous uint8 [rows, whole blocks]");
    const int64_t c = w.size(1) / bb * block_values(t);
    TORCH_CHECK(cols < 0 || c == cols, "DecodeLayers: the parts of a matrix have one input size");
    cols = c;
    out.push_back({w, t, w.size(0), offset});
    offset += w.size(0);
  }
  return out;
}
}  // namespace

DecodeLayers::DecodeLayers(std::vector<std::vector<torch::Tensor>> weights_, std::vector<torch::Tensor> k_caches_,
                           std::vector<torch::Tensor> v_caches_, torch::Tensor cos_, torch::Tensor sin_,
                           int64_t num_heads_, int64_t num_kv_heads_, double eps_, double scale_,
                           std::vector<int64_t> windows_, std::vector<std::vector<int64_t>> types_)
    : k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)), windows(std::move(windows_)),
      cos(std::move(cos_)), sin(std::move(sin_)), num_heads(num_heads_), num_kv_heads(num_kv_heads_), eps(eps_),
      scale(scale_) {
#ifndef __AVX2__
  TORCH_CHECK(false, "DecodeLayers: built without AVX2");
#endif
  TORCH_CHECK(!k_caches.empty() && weights_.size() == k_caches.size() * kPerLayer &&
                  v_caches.size() == k_caches.size() && windows.size() == k_caches.size(),
              "DecodeLayers: ", kPerLayer, " tensors per layer, one cache and one window each");
  TORCH_CHECK(types_.size() == weights_.size(), "DecodeLayers: one list of types per tensor");
  for (int64_t w : windows) TORCH_CHECK(w >= 0, "DecodeLayers: sliding windows >= 0 (0: none)");
  for (size_t i = 0; i < weights_.size(); ++i) parts.push_back(make_parts(i, std::move(weights_[i]), types_[i]));
  for (size_t l = 0; l < k_caches.size(); ++l)
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == torch::kFloat32, "DecodeLayers: contiguous float32 caches");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  cos.size(1) == k_caches[0].size(3), "DecodeLayers: float32 rotary tables [max_pos, head_dim]");
}

int64_t DecodeLayers::cols(size_t i) const {
  const Part& p = parts[i][0];
  return p.type ? p.w.size(1) / block_bytes(p.type) * block_values(p.type) : p.w.size(1);
}

int64_t DecodeLayers::rows(size_t i) const { return parts[i].back().offset + parts[i].back().rows; }

void DecodeLayers::set_head(torch::Tensor norm_weight, torch::Tensor head_blocks, int64_t head_type) {
  const int64_t hidden = parts[0][0].w.numel();
  const int64_t bb = block_bytes(head_type);
  TORCH_CHECK(bb > 0, "set_head: GGUF blocks of ggml_type 2, 3, 8, 12, 13 or 14, not ", head_type);
  TORCH_CHECK(norm_weight.is_contiguous() && norm_weight.scalar_type() == torch::kFloat32 &&
                  norm_weight.numel() == hidden, "set_head: a float32 norm weight of the hidden size");
  const int64_t nv = block_values(head_type);
  TORCH_CHECK(head_blocks.dim() == 2 && head_blocks.is_contiguous() && head_blocks.scalar_type() == torch::kUInt8 &&
                  hidden % nv == 0 && head_blocks.size(1) == hidden / nv * bb,
              "set_head: LM head contiguous uint8 [rows, whole blocks of the hidden size]");
  head_norm = std::move(norm_weight);
  head = {std::move(head_blocks), head_type, 0, 0};
  head.rows = head.w.size(0);
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
  TORCH_CHECK(head.w.defined(), "decode_layers.logits: no head (set_head)");
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
  for (int64_t l = 0; l < static_cast<int64_t>(k_caches.size()); ++l) {
    const size_t i = l * kPerLayer;
    TORCH_CHECK(rows(i + 1) == qkv_size && cols(i + 1) == hidden && rows(i + 3) == hidden && cols(i + 3) == q_size &&
                    rows(i + 6) == 2 * inter && cols(i + 6) == hidden && rows(i + 8) == hidden && cols(i + 8) == inter &&
                    parts[i][0].w.numel() == hidden && parts[i + 5][0].w.numel() == hidden,
                "decode_layers: weights of another model shape");
  }
  auto opts = h.options();
  torch::Tensor residual = h;  // h is this step's own embeddings: the sum may start in it
  auto x = torch::empty({T, hidden}, opts), qkv = torch::empty({T, qkv_size}, opts);
  auto attn = torch::empty({T, q_size}, opts), gate_up = torch::empty({T, 2 * inter}, opts);
  auto act = torch::empty({T, inter}, opts);
  auto interleaved = torch::empty({T, std::max({hidden, q_size, inter})}, opts);
  float *rp = residual.data_ptr<float>(), *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *ap = attn.data_ptr<float>(), *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  float* ip = interleaved.data_ptr<float>();
  // A GGUF linear's input rows as 8-bit activation blocks, a buffer for each kind.
  const int64_t rows_q = std::max(T, li != nullptr ? li->numel() : int64_t{0});  // the head's rows too
  const int64_t kind_bytes = act_bytes(rows_q, std::max({hidden, q_size, inter}));
  auto xq = torch::empty({kActKinds * kind_bytes}, opts.dtype(torch::kUInt8));
  uint8_t* const xqp = xq.data_ptr<uint8_t>();
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
    V = head.rows;
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
    // Rows [t0, t1) of in (K wide) as the activation blocks of every kind
    // a matrix's parts multiply, each into its kind's buffer.
    auto quantize_for = [&](const std::vector<Part>& m, const float* in, int64_t K, int64_t t0, int64_t t1) {
      bool done[kActKinds] = {};
      for (const Part& p : m) {
        if (p.type == 0) continue;  // float
        const int k = act_kind(p.type);
        if (!done[k]) quantize_kind(k, in, xqp + k * kind_bytes, K, t0, t1);
        done[k] = true;
      }
    };
    // y = in w^T + b over this thread's weight rows; in's rows are K wide.
    // GGUF blocks: in's rows quantized once for each kind its parts need,
    // split by rows (quantized: already done by the op that wrote them,
    // which saves a barrier), then each part's tiles over this thread's
    // share of its rows, as gguf_linear or gguf_linear_k, and then + b.
    auto linear = [&](const float* in, int64_t K, const std::vector<Part>& m, const torch::Tensor& b, float* y,
                      bool quantized) {
      int64_t n0, n1;
      const torch::Tensor& w = m[0].w;
      const int64_t N = m.back().offset + m.back().rows;
      if (m[0].type != 0) {
        if (!quantized) {
          quantize_for(m, in, K, r0, r1);
#pragma omp barrier
        }
        const float* bp = data_or_null(b);
        for (const Part& p : m) {
          share(p.rows, 16, tid, nt, n0, n1);  // whole packed groups
          multiply(p, xqp + act_kind(p.type) * kind_bytes, y + p.offset, N, T, K, n0, n1);
          if (bp != nullptr)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t n = p.offset + n0; n < p.offset + n1; ++n) y[t * N + n] += bp[n];
        }
#pragma omp barrier
        return;
      }
      share(N, 4, tid, nt, n0, n1);
      if (w.scalar_type() == torch::kBFloat16) {
        for (int64_t t = r0; t < r1; ++t) interleave_for_bf16(in + t * K, ip + t * K, K);
        in = ip;
#pragma omp barrier
      }
      linear_rows(in, w, data_or_null(b), y, T, n0, n1);
#pragma omp barrier
    };
    for (int64_t l = 0; l < L; ++l) {
      const std::vector<Part>* w = parts.data() + l * kPerLayer;
      const float* in_norm = w[0][0].w.data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t) {
        float* r = rp + t * hidden;
        float* xr = xp + t * hidden;
        if (l > 0)  // the first layer's norm has no pending output to add (see LlamaDecoderLayer)
          for (int64_t j = 0; j < hidden; ++j) r[j] += xr[j];
        norm_row(r, in_norm, xr, hidden, e);
        quantize_for(w[1], xp, hidden, t, t + 1);
      }
#pragma omp barrier
      mark(0);
      linear(xp, hidden, w[1], w[2][0].w, qkvp, true);
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
      linear(ap, q_size, w[3], w[4][0].w, xp, false);  // attention's rows are split by head
      mark(4);
      const float* post_norm = w[5][0].w.data_ptr<float>();
      for (int64_t t = r0; t < r1; ++t) {
        float* r = rp + t * hidden;
        float* xr = xp + t * hidden;
        for (int64_t j = 0; j < hidden; ++j) r[j] += xr[j];
        norm_row(r, post_norm, xr, hidden, e);
        quantize_for(w[6], xp, hidden, t, t + 1);
      }
#pragma omp barrier
      mark(5);
      linear(xp, hidden, w[6], w[7][0].w, gup, true);
      mark(6);
      for (int64_t t = r0; t < r1; ++t) {
        silu_mul_row(gup + t * 2 * inter, actp + t * inter, inter);
        quantize_for(w[8], actp, inter, t, t + 1);
      }
#pragma omp barrier
      mark(7);
      linear(actp, inter, w[8], w[9][0].w, xp, true);
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
        quantize_kind(act_kind(head.type), np, xqp + act_kind(head.type) * kind_bytes, hidden, i, i + 1);
      }
#pragma omp barrier
      int64_t n0, n1;
      share(V, 16, tid, nt, n0, n1);
      multiply(head, xqp + act_kind(head.type) * kind_bytes, lp, V, R, hidden, n0, n1);
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
