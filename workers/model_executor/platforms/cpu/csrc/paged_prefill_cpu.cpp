// Prefill attention straight from the paged KV cache, on the CPU (float32).
//
// The torch path copies a chunk's blocks out of the cache (when context
// came before it) and hands them to SDPA with a dense [n, keys] mask. Here
// each job is one tile of a chunk's query positions for one KV head: the
// tile's queries for every query head of the group (grouped-query attention
// reads each key and value once for all of them) attend over the keys in
// tiles of kKeys, flash-attention style: a key tile is packed transposed
// into a small buffer, scored against all the tile's rows in registers, and
// folded into each row's running max, sum and output (online softmax, float32
// throughout). Query tile, key tile, scores and outputs stay within L2.
// Causal by position (a query at p sees keys <= p) and, under a sliding
// window W, keys > p - W only. A job's result does not depend on which
// thread runs it or how many there are: bit-identical across thread counts.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "avx2_math.h"
#include "cpu_kernels.h"

namespace {

constexpr int64_t kKeys = 64;      // keys a tile (a multiple of 16: the score kernel's width)
constexpr int64_t kTileRows = 96;  // query rows (positions x the group's heads) a tile aims at

struct Prefill {
  const float* q;
  int64_t q_row;  // floats between two tokens' queries (heads are D apart)
  float* out;
  int64_t out_row;
  const float* k_cache;
  const float* v_cache;
  const int64_t* tables;  // [chunks, max_blocks]
  int64_t max_blocks;
  const int64_t* starts;        // a chunk's first row of q
  const int64_t* query_lens;    // its queries
  const int64_t* context_lens;  // its keys (the chunk's own included)
  int64_t H, KVH, D, bs;
  float scale;
  int64_t window;  // > 0: a query at p sees keys > p - window only
};

struct Job {
  int64_t chunk, head, i0, i1;  // queries [i0, i1) of the chunk, KV head `head`
};

struct Scratch {
  std::vector<float> q, kt, s, o, m, l;
  std::vector<const float*> vrow;
};

// A query at chunk offset i is at position ctx - n + i; its keys are [lo(p), p].
inline int64_t key_lo(const Prefill& a, int64_t p) { return a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0; }

#ifdef __AVX2__
// Kt[d .. d + 8, 0 .. 8) (row stride ldk) = dims d .. d + 8 of the 8 keys at rows[0 .. 8).
inline void transpose8(const float* const* rows, int64_t d, float* kt, int64_t ldk) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows[j] + d);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  // r[0..3]: dims (0,4) (1,5) (2,6) (3,7) of keys 0..3 in the low/high lanes; r[4..7] of keys 4..7.
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(kt + j * ldk, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(kt + (j + 4) * ldk, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}

// S[r, 0:16*NK) = Q[r] . Kt[:, 0:16*NK) for RB rows: RB x 2 accumulators a key pair of vectors.
template <int RB>
inline void score_rows(const float* q, int64_t D, const float* kt, int64_t ldk, float* s, int64_t lds, int64_t nk16) {
  for (int64_t c = 0; c < nk16; ++c) {
    __m256 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* kc = kt + 16 * c;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kc + d * ldk), k1 = _mm256_loadu_ps(kc + d * ldk + 8);
      for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(s + r * lds + 16 * c, acc[r][0]);
      _mm256_storeu_ps(s + r * lds + 16 * c + 8, acc[r][1]);
    }
  }
}

// O[r] += sum_t P[r, t] V[t] over keys [t0, t1) for RB rows sharing them, 32 dims at a time.
template <int RB>
inline void accumulate_rows(const float* p, int64_t ldp, const float* const* vrow, int64_t t0, int64_t t1, float* o,
                            int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 acc[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_loadu_ps(o + r * D + d0 + 8 * j);
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = vrow[t] + d0;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
      for (int r = 0; r < RB; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * ldp + t);
        acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(pv, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(pv, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + r * D + d0 + 8 * j, acc[r][j]);
  }
  for (; d0 < D; d0 += 8) {  // D % 8 == 0 on this path
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_loadu_ps(o + r * D + d0);
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 v = _mm256_loadu_ps(vrow[t] + d0);
      for (int r = 0; r < RB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * ldp + t), v, acc[r]);
    }
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(o + r * D + d0, acc[r]);
  }
}
#endif

void run_job(const Prefill& a, const Job& job, Scratch& w) {
  const int64_t D = a.D, G = a.H / a.KVH, bs = a.bs, tok_stride = a.KVH * D;
  const int64_t n = a.query_lens[job.chunk], ctx = a.context_lens[job.chunk];
  const int64_t* table = a.tables + job.chunk * a.max_blocks;
  const int64_t P = job.i1 - job.i0, R = P * G;  // rows: r = i * G + g
  const int64_t p_first = ctx - n + job.i0, p_last = ctx - n + job.i1 - 1;
#ifdef __AVX2__
  const bool simd = D % 8 == 0;
#else
  const bool simd = false;
#endif
  w.q.resize(R * D);
  w.o.assign(R * D, 0.f);
  w.m.assign(R, -std::numeric_limits<float>::infinity());
  w.l.assign(R, 0.f);
  w.kt.resize(D * kKeys);
  w.s.resize(R * kKeys);
  w.vrow.resize(kKeys);
  // The tile's queries, scaled once (the scores come out scaled).
  for (int64_t i = 0; i < P; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + (a.starts[job.chunk] + job.i0 + i) * a.q_row + (job.head * G + g) * D;
      float* dst = w.q.data() + (i * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
    }
  const float* k_head = a.k_cache + job.head * D;
  const float* v_head = a.v_cache + job.head * D;
  auto row_at = [&](const float* head, int64_t pos) { return head + (table[pos / bs] * bs + pos % bs) * tok_stride; };
  for (int64_t k0 = key_lo(a, p_first); k0 <= p_last; k0 += kKeys) {
    const int64_t kn = std::min(kKeys, p_last + 1 - k0);
    const int64_t kn16 = (kn + 15) / 16;  // score columns computed (the padding's keys are zeros)
    // Pack the key tile transposed (Kt[d, t]) and note where each value row is.
    const float* krows[kKeys];
    for (int64_t t = 0; t < kn; ++t) {
      krows[t] = row_at(k_head, k0 + t);
      w.vrow[t] = row_at(v_head, k0 + t);
    }
    int64_t t8 = 0;
#ifdef __AVX2__
    if (simd)  // 8 keys x 8 dims at a time, transposed in registers
      for (; t8 + 8 <= kn; t8 += 8)
        for (int64_t d = 0; d < D; d += 8) transpose8(krows + t8, d, w.kt.data() + d * kKeys + t8, kKeys);
#endif
    for (int64_t t = t8; t < kn; ++t)
      for (int64_t d = 0; d < D; ++d) w.kt[d * kKeys + t] = krows[t][d];
    for (int64_t t = kn; t < kn16 * 16; ++t)
      for (int64_t d = 0; d < D; ++d) w.kt[d * kKeys + t] = 0.f;
    // Scores of every row against the tile.
#ifdef __AVX2__
    if (simd) {
      int64_t r = 0;
      for (; r + 6 <= R; r += 6)
        score_rows<6>(w.q.data() + r * D, D, w.kt.data(), kKeys, w.s.data() + r * kKeys, kKeys, kn16);
      const float* qr = w.q.data() + r * D;
      float* sr = w.s.data() + r * kKeys;
      switch (R - r) {
        case 5: score_rows<5>(qr, D, w.kt.data(), kKeys, sr, kKeys, kn16); break;
        case 4: score_rows<4>(qr, D, w.kt.data(), kKeys, sr, kKeys, kn16); break;
        case 3: score_rows<3>(qr, D, w.kt.data(), kKeys, sr, kKeys, kn16); break;
        case 2: score_rows<2>(qr, D, w.kt.data(), kKeys, sr, kKeys, kn16); break;
        case 1: score_rows<1>(qr, D, w.kt.data(), kKeys, sr, kKeys, kn16); break;
        default: break;
      }
    }
#endif
    if (!simd) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < kn; ++t) {
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += w.q[r * D + d] * w.kt[d * kKeys + t];
          w.s[r * kKeys + t] = acc;
        }
    }
    // Per query position: its keys in this tile are [t0, t1); fold them into its rows.
    for (int64_t i = 0; i < P; ++i) {
      const int64_t p = p_first + i;
      const int64_t t0 = std::max<int64_t>(0, key_lo(a, p) - k0), t1 = std::min(kn, p + 1 - k0);
      if (t1 <= t0) continue;  // every key of the tile is past it, or before its window
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        float* srow = w.s.data() + r * kKeys;
        float mx = w.m[r];
        int64_t t = t0;
#ifdef __AVX2__
        if (simd && t1 - t0 >= 8) {  // a vector max: a scalar chain of them would outlast the FMAs
          __m256 vmx = _mm256_set1_ps(mx);
          for (; t + 8 <= t1; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(srow + t));
          __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
          h = _mm_max_ps(h, _mm_movehl_ps(h, h));
          mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        }
#endif
        for (; t < t1; ++t) mx = std::max(mx, srow[t]);
        const float alpha = std::exp(w.m[r] - mx);  // 0 on the row's first keys (m = -inf)
        float sum = 0.f;
        t = t0;
#ifdef __AVX2__
        if (simd) {
          __m256 vsum = _mm256_setzero_ps();
          const __m256 vm = _mm256_set1_ps(mx);
          for (; t + 8 <= t1; t += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(srow + t), vm));
            _mm256_storeu_ps(srow + t, e);
            vsum = _mm256_add_ps(vsum, e);
          }
          sum = hsum256(vsum);
        }
#endif
        for (; t < t1; ++t) {
          srow[t] = std::exp(srow[t] - mx);
          sum += srow[t];
        }
        w.m[r] = mx;
        w.l[r] = w.l[r] * alpha + sum;
        if (alpha != 1.f) {
          float* orow = w.o.data() + r * D;
          for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        }
      }
      float* o = w.o.data() + i * G * D;
      const float* prow = w.s.data() + i * G * kKeys;
#ifdef __AVX2__
      if (simd) {
        int64_t g = 0;
        for (; g + 3 <= G; g += 3) accumulate_rows<3>(prow + g * kKeys, kKeys, w.vrow.data(), t0, t1, o + g * D, D);
        if (G - g == 2) accumulate_rows<2>(prow + g * kKeys, kKeys, w.vrow.data(), t0, t1, o + g * D, D);
        if (G - g == 1) accumulate_rows<1>(prow + g * kKeys, kKeys, w.vrow.data(), t0, t1, o + g * D, D);
        continue;
      }
#endif
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = t0; t < t1; ++t) {
          const float pt = prow[g * kKeys + t];
          const float* v = w.vrow[t];
          float* og = o + g * D;
          for (int64_t d = 0; d < D; ++d) og[d] += pt * v[d];
        }
    }
  }
  for (int64_t i = 0; i < P; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = 1.f / w.l[r];
      float* dst = a.out + (a.starts[job.chunk] + job.i0 + i) * a.out_row + (job.head * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = w.o[r * D + d] * inv;
    }
}

}  // namespace

void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                             torch::Tensor context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 &&
                  k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_prefill_attention: contiguous caches only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_prefill_attention: q and out [T, H, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_prefill_attention: each token's heads contiguous in q and out");
  for (const auto* t : {&block_tables, &query_starts, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "paged_prefill_attention: int64 metadata");
  TORCH_CHECK(sliding_window >= 0, "paged_prefill_attention: sliding_window >= 0 (0: none)");
  const int64_t C = query_starts.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "paged_prefill_attention: heads a multiple of the KV heads");
  TORCH_CHECK(block_tables.size(0) == C && query_lens.size(0) == C && context_lens.size(0) == C,
              "paged_prefill_attention: one table, start and lengths a chunk");
  const Prefill a{q.data_ptr<float>(),        q.stride(0),
                  out.data_ptr<float>(),      out.stride(0),
                  k_cache.data_ptr<float>(),  v_cache.data_ptr<float>(),
                  block_tables.data_ptr<int64_t>(), block_tables.size(1),
                  query_starts.data_ptr<int64_t>(), query_lens.data_ptr<int64_t>(),
                  context_lens.data_ptr<int64_t>(), H,
                  KVH,                        D,
                  k_cache.size(1),            static_cast<float>(scale),
                  sliding_window};
  const int64_t G = H / KVH, positions = std::max<int64_t>(1, kTileRows / G);
  // Jobs, longest first (a causal tile's keys grow with its position), taken
  // by whichever thread is free: the split of work does not change a result.
  std::vector<Job> jobs;
  double work = 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t n = a.query_lens[c], ctx = a.context_lens[c];
    TORCH_CHECK(n > 0 && n <= ctx && (ctx + a.bs - 1) / a.bs <= a.max_blocks,
                "paged_prefill_attention: 0 < query_len <= context_len within the block table");
    TORCH_CHECK(a.starts[c] >= 0 && a.starts[c] + n <= q.size(0), "paged_prefill_attention: queries within q");
    for (int64_t i0 = (n - 1) / positions * positions; i0 >= 0; i0 -= positions)
      for (int64_t h = 0; h < KVH; ++h) jobs.push_back({c, h, i0, std::min(n, i0 + positions)});
    work += static_cast<double>(n) * (sliding_window ? std::min(ctx, sliding_window) : ctx) * H * D;
  }
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& x, const Job& y) {
    return a.context_lens[x.chunk] - a.query_lens[x.chunk] + x.i1 > a.context_lens[y.chunk] - a.query_lens[y.chunk] + y.i1;
  });
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  // Waking the other threads costs tens of microseconds: a small step runs here.
  const int64_t threads = work < 2e6 ? 1 : std::min<int64_t>(at::get_num_threads(), num_jobs);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = next.fetch_add(1); j < num_jobs; j = next.fetch_add(1)) run_job(a, jobs[j], w);
  });
}
