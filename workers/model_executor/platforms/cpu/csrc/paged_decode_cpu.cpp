// Decode attention straight from the paged KV cache, on the CPU (float32).
//
// The torch backend gathers each sequence's blocks into a padded tensor and
// then attends over it: every key and value is read, written and read again.
// Here each (sequence, kv head) pair walks its block table and reads each key
// and value once, for all the query heads that share it (grouped-query
// attention), with an exact two-pass softmax. AVX2 paths for the dot
// products and exp; plain loops elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

#include "avx2_math.h"
#include "cpu_kernels.h"

void attend_job(const PagedAttn& a, int64_t job, std::vector<float>& scores, std::vector<float>& acc, int64_t g0,
                int64_t g1) {
  const int64_t D = a.D, bs = a.bs, KVH = a.KVH, G = a.H / a.KVH, tok_stride = KVH * D;
  const float sc = a.scale;
  const int64_t s = job / KVH, h = job % KVH, L = a.lens[s];
  // Keys [lo, L): the whole context, or under a sliding window its last
  // `window` positions (the query's own included). Score t belongs to key lo + t.
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, L - a.window) : 0, n = L - lo;
  scores.resize(G * n);
  const float* qh = a.q + s * a.q_row + h * G * D;
  const int64_t b_lo = lo / bs, nblk = (L + bs - 1) / bs;
  // Block b holds keys b * bs + [first(b), last(b)) of the range.
  auto first = [&](int64_t b) { return std::max<int64_t>(0, lo - b * bs); };
  auto last = [&](int64_t b) { return std::min(bs, L - b * bs); };
  // At batch 1 the cache comes from memory (a step's weight reads push it
  // out of L3) in rows of D floats strided KVH * D apart, which the
  // hardware prefetcher does not run ahead of (measured at a 150-token
  // context: 1.36 -> 1.16 ms of attention a bfloat16 step with the prefetch
  // below). So the first block's keys are fetched up front and, while a
  // block's keys are scored, the next block's keys and this block's values.
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(float));
  auto fetch = [&](const float* row) {
    for (int64_t off = 0; off < row_bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(row) + off, 0, 3);
  };
  auto block = [&](const float* cache, int64_t b) {  // this head's rows in block b of the sequence
    return cache + (a.tables[s * a.max_blocks + b] * bs * KVH + h) * D;
  };
  for (int64_t i = first(b_lo); i < last(b_lo); ++i) fetch(block(a.k_cache, b_lo) + i * tok_stride);
  for (int64_t b = b_lo; b < nblk; ++b) {
    const int64_t i0 = first(b), tn = last(b);
    const float* blk = block(a.k_cache, b) + i0 * tok_stride;  // from the block's first key in range
    const int64_t t0 = b * bs + i0 - lo, m = tn - i0;            // its scores are t0 .. t0 + m
    {
      const float* vblk = block(a.v_cache, b);
      const float* next = b + 1 < nblk ? block(a.k_cache, b + 1) : nullptr;
      const int64_t next_n = b + 1 < nblk ? last(b + 1) : 0;
      for (int64_t i = 0; i < std::max(tn, next_n); ++i) {
        if (i >= i0 && i < tn) fetch(vblk + i * tok_stride);
        if (i < next_n) fetch(next + i * tok_stride);
      }
    }
#ifdef __AVX2__
    if (D % 8 == 0) {
      for (int64_t g = g0; g < g1; ++g) {
        const float* qg = qh + g * D;
        float* srow = scores.data() + g * n + t0;
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
          const float* k0 = blk + i * tok_stride;
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + tok_stride + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * tok_stride + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * tok_stride + d), a3);
          }
          srow[i] = hsum256(a0) * sc;
          srow[i + 1] = hsum256(a1) * sc;
          srow[i + 2] = hsum256(a2) * sc;
          srow[i + 3] = hsum256(a3) * sc;
        }
        for (; i < m; ++i) {
          const float* key = blk + i * tok_stride;
          __m256 a0 = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(key + d), a0);
          srow[i] = hsum256(a0) * sc;
        }
      }
      continue;  // the scalar loop below is for other head sizes / CPUs
    }
#endif
    for (int64_t i = 0; i < m; ++i) {
      const float* key = blk + i * tok_stride;
      for (int64_t g = g0; g < g1; ++g) {
        const float* qg = qh + g * D;
        float a = 0.f;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < D; ++d) a += qg[d] * key[d];
        scores[g * n + t0 + i] = a * sc;
      }
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    float* row = scores.data() + g * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, row[t]);
    float sum = 0.f;
    int64_t t = 0;
#ifdef __AVX2__
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + t), vm));
      _mm256_storeu_ps(row + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum256(vsum);
#endif
    for (; t < n; ++t) {
      row[t] = std::exp(row[t] - m);
      sum += row[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t u = 0; u < n; ++u) row[u] *= inv;
  }
#ifdef __AVX2__
  if (D % 8 == 0) {
    // Each query head's output, 64 dims at a time, stays in registers over
    // the whole context (through memory, every value row cost a load and a
    // store of the accumulator as well).
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nv = std::min<int64_t>(64, D - d0) / 8;
        __m256 o[8];
        for (int64_t j = 0; j < 8; ++j) o[j] = _mm256_setzero_ps();
        for (int64_t b = b_lo; b < nblk; ++b) {
          const int64_t i0 = first(b), m = last(b) - i0;
          const float* blk = block(a.v_cache, b) + i0 * tok_stride + d0;
          const float* prow = scores.data() + g * n + b * bs + i0 - lo;
          for (int64_t i = 0; i < m; ++i) {
            const __m256 p = _mm256_set1_ps(prow[i]);
            const float* val = blk + i * tok_stride;
            for (int64_t j = 0; j < nv; ++j) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(val + 8 * j), o[j]);
          }
        }
        float* out = a.out + s * a.out_row + (h * G + g) * D + d0;
        for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(out + 8 * j, o[j]);
      }
    return;
  }
#endif
  acc.assign(G * D, 0.f);
  for (int64_t b = b_lo; b < nblk; ++b) {
    const int64_t i0 = first(b), m = last(b) - i0;
    const float* blk = block(a.v_cache, b) + i0 * tok_stride;
    for (int64_t g = g0; g < g1; ++g) {
      float* a = acc.data() + g * D;
      const float* prow = scores.data() + g * n + b * bs + i0 - lo;
      for (int64_t i = 0; i < m; ++i) {
        const float p = prow[i];
        const float* val = blk + i * tok_stride;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * val[d];
      }
    }
  }
  for (int64_t g = g0; g < g1; ++g)
    std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, a.out + s * a.out_row + (h * G + g) * D);
}

// q: [n, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D];
// block_tables: [n, max_blocks] int64; context_lens: [n] int64 -> [n, H, D].
// sliding_window > 0: each query attends to its last sliding_window positions only.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: int64 block tables and lengths");
  TORCH_CHECK(sliding_window >= 0, "paged_decode_attention: sliding_window >= 0 (0: none)");
  q = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  auto out = torch::empty_like(q);
  const PagedAttn a{q.data_ptr<float>(), H * D, out.data_ptr<float>(), H * D, k_cache.data_ptr<float>(),
                    v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(),
                    H, KVH, D, k_cache.size(1), static_cast<float>(scale), sliding_window};
  // Waking the other threads costs tens of microseconds: a step whose keys
  // and values fit in L2 (one short sequence, say) runs on this thread.
  int64_t total_len = 0;
  for (int64_t s = 0; s < n; ++s) total_len += sliding_window ? std::min(a.lens[s], sliding_window) : a.lens[s];
  const int64_t grain = 2 * total_len * KVH * D * static_cast<int64_t>(sizeof(float)) < (256 << 10) ? n * KVH : 1;
  at::parallel_for(0, n * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t job = begin; job < end; ++job) attend_job(a, job, scores, acc, 0, H / KVH);
  });
  return out;
}
