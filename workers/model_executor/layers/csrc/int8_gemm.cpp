// y = x W^T with W int8 [N, K] (per output channel scales) and x quantized
// per token at the call: INT8 W8A8 (--quantization int8, compressed-tensors'
// int8 checkpoints).
//
// Every row m of x is quantized symmetric: s_x = max|x_m| / 127 (float32),
// q = round-to-nearest-even(x / s_x) clamped to [-127, 127] (a zero row:
// s_x = 0, q = 0). Each output is one exact int32 dot product over the whole
// K, then y[m, n] = fma(float(acc) * s_x[m], w_scale[n], bias[n] or 0): the
// same float operations on every path, and the integers are exact, so the
// scalar, AVX2 and AVX-512 VNNI paths give the same bits (tests). |acc| <=
// 127 * 127 * K fits int32 for K < 133k; the lanes below may wrap on the way
// (the VNNI bias terms), which two's complement undoes.
//
// The dot products (32 bytes of K a step, the rest scalar):
//   AVX-512 VNNI (set_isa "avx512"): vpdpbusd wants u8 x s8. In the GEMM x
//   goes in as x + 128 (an xor of the sign bit) and each weight row's
//   128 * sum(w) is taken off at the end, summed by one more vpdpbusd per
//   row and block (R + C extra instructions per R x C tile, not R * C sign
//   fix-ups); the GEMV takes vpdpbusd(|x|, sign(w, x)).
//   AVX2: vpmaddubsw(|x|, sign(w, x)) + vpmaddwd with ones; |x|, |w| <= 127
//   keep its int16 pair sums (<= 2 * 127 * 127) from saturating.
// Threads split the weight rows in runs of whole 4-row tiles. One row of x
// (decode): 4 weight rows at a time; from two rows, tiles of 4 weight rows x
// 4 rows of x (16 accumulators; the 1-3 rows left over in one smaller tile),
// x in chunks of 64 rows so they stay in L2 while the weight tiles pass.
// Software prefetch runs two tiles ahead (four short row streams the
// hardware prefetcher does not follow; as gguf_gemv.cpp).
// Measured (1 thread, Zen 4, shared machine: best of 15 interleaved rounds,
// 576 x 1536 and 1536 x 576, weights in cache): M = 1, 11-12 us (VNNI) and
// 12-14 us (AVX2), 3.1-3.4x faster than the float32 small_m_linear, 5.5-6x
// F.linear; M = 256, 166-199 GOP/s (VNNI) and 142-172 (AVX2), 1.35-1.65x
// small_m_linear, 2.2-2.5x F.linear; faster than gguf_linear's Q8_0 at 1, 64
// and 256 rows (its per-block scales cost an fma a block).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx2_math.h"
#include "cpu_kernels.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStep = 32;  // bytes of K a vector step

// ---------------------------------------------------------------- activations

void quantize_row_scalar(const float* x, int8_t* q, float* s, int64_t K) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  *s = d;
  for (int64_t k = 0; k < K; ++k) {
    const float v = d != 0.f ? std::nearbyint(x[k] / d) : 0.f;  // the default rounding: to nearest even
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

#ifdef __AVX2__
void quantize_row_avx2(const float* x, int8_t* q, float* s, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  *s = d;
  if (d == 0.f) {
    std::fill(q, q + K, int8_t{0});
    return;
  }
  const __m256 dv = _mm256_set1_ps(d);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const auto conv = [&](const float* p) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(r)));
  };
  for (k = 0; k + 32 <= K; k += 32) {
    const __m256i p01 = _mm256_packs_epi32(conv(x + k), conv(x + k + 8));
    const __m256i p23 = _mm256_packs_epi32(conv(x + k + 16), conv(x + k + 24));
    // The packs interleave 128-bit halves; the permute puts them back in order.
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), p);
  }
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / d))));
}
#endif

void quantize_rows(const float* x, int8_t* q, float* s, int64_t M, int64_t K, bool scalar) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#ifdef __AVX2__
      if (!scalar) {
        quantize_row_avx2(x + m * K, q + m * K, s + m, K);
        continue;
      }
#endif
      quantize_row_scalar(x + m * K, q + m * K, s + m, K);
    }
  });
}

// ------------------------------------------------------------ dot products

inline float epilogue(int32_t acc, float sx, float sw, const float* bias, int64_t n) {
  return std::fma(static_cast<float>(acc) * sx, sw, bias ? bias[n] : 0.f);
}

inline int32_t dot_scalar(const int8_t* w, const int8_t* a, int64_t K) {
  int32_t acc = 0;
  for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(w[k]) * a[k];
  return acc;
}

#ifdef __AVX2__
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// src + u8 x s8 products, 4 adjacent ones summed into each int32 lane.
template <bool V>
inline __m256i dpbusd(__m256i src, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (V) return _mm256_dpbusd_epi32(src, u, s);
#endif
  return _mm256_add_epi32(src, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// A register tile: R weight rows (stride K) against C rows of quantized x
// (stride K); y[c * N + r] for row r and x row c.
template <bool V, int R, int C>
void tile(const int8_t* w, const int8_t* a, const float* sx, const float* sw, const float* bias, int64_t n, int64_t K,
          float* y, int64_t N, bool pf) {
  constexpr int64_t kAhead = 2;  // tiles of R rows
  const int64_t steps = K / kStep;
  // The +128 offset pays from two rows of x on (R + C extra instructions, not
  // R * C sign fix-ups); one row takes the sign trick, which costs no vpdpbusd.
  constexpr bool kFlip = V && C > 1;
  const __m256i zero = _mm256_setzero_si256(), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i acc[R][C], wsum[R];
  for (int r = 0; r < R; ++r) {
    wsum[r] = zero;
    for (int c = 0; c < C; ++c) acc[r][c] = zero;
  }
  for (int64_t b = 0; b < steps; ++b) {
    __m256i ya[C], yabs[C];
    for (int c = 0; c < C; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c * K + b * kStep));
      if (kFlip)
        ya[c] = _mm256_xor_si256(v, flip);  // x + 128, unsigned
      else
        ya[c] = v, yabs[c] = _mm256_sign_epi8(v, v);
    }
    if (pf && R > 1) {
      // The tile's R rows are one run of R * K bytes: fetch the one kAhead tiles on.
      const char* p = reinterpret_cast<const char*>(w + kAhead * R * K + b * R * kStep);
      for (int64_t o = 0; o < R * kStep; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + b * kStep));
      if (kFlip) wsum[r] = dpbusd<V>(wsum[r], flip, wv);  // 128 * sum(w), taken off at the end
      for (int c = 0; c < C; ++c) {
        if (kFlip)
          acc[r][c] = dpbusd<V>(acc[r][c], ya[c], wv);
        else
          acc[r][c] = dpbusd<V>(acc[r][c], yabs[c], _mm256_sign_epi8(wv, ya[c]));
      }
    }
  }
  const int64_t k0 = steps * kStep;
  for (int r = 0; r < R; ++r) {
    const int32_t bias_r = kFlip ? hsum_epi32(wsum[r]) : 0;
    for (int c = 0; c < C; ++c) {
      // Wrapping int32 arithmetic: exact once the true sum fits.
      const uint32_t v = static_cast<uint32_t>(hsum_epi32(acc[r][c])) - static_cast<uint32_t>(bias_r) +
                         static_cast<uint32_t>(dot_scalar(w + r * K + k0, a + c * K + k0, K - k0));
      y[c * N + n + r] = epilogue(static_cast<int32_t>(v), sx[c], sw[n + r], bias, n + r);
    }
  }
}

// The tiles of R weight rows from row n against x rows [m0, m1): C rows at a
// time, then the 1 to 3 left over (C = 4) in one tile.
template <bool V, int R, int C>
void tile_rows(const int8_t* w, const int8_t* xq, const float* sx, const float* sw, const float* bias, int64_t n,
               int64_t K, float* y, int64_t N, int64_t m0, int64_t m1) {
  const int8_t* wr = w + n * K;
  int64_t m = m0;
  for (; m + C <= m1; m += C) tile<V, R, C>(wr, xq + m * K, sx + m, sw, bias, n, K, y + m * N, N, m == m0);
  static_assert(C == 1 || C == 4);
  if constexpr (C == 4) {
    const bool pf = m == m0;
    if (m1 - m == 3)
      tile<V, R, 3>(wr, xq + m * K, sx + m, sw, bias, n, K, y + m * N, N, pf);
    else if (m1 - m == 2)
      tile<V, R, 2>(wr, xq + m * K, sx + m, sw, bias, n, K, y + m * N, N, pf);
    else if (m1 - m == 1)
      tile<V, R, 1>(wr, xq + m * K, sx + m, sw, bias, n, K, y + m * N, N, pf);
  }
}

constexpr int kR = 4, kC = 4;
constexpr int64_t kChunk = 64;

template <bool V>
void gemm_range(const int8_t* xq, const float* sx, const int8_t* w, const float* sw, const float* bias, float* y,
                int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 1) {  // the GEMV: four weight rows at a time
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile_rows<V, 4, 1>(w, xq, sx, sw, bias, n, K, y, N, 0, M);
    for (; n < n1; ++n) tile_rows<V, 1, 1>(w, xq, sx, sw, bias, n, K, y, N, 0, M);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t m1 = std::min(M, m0 + kChunk);
    int64_t n = n0;
    for (; n + kR <= n1; n += kR) tile_rows<V, kR, kC>(w, xq, sx, sw, bias, n, K, y, N, m0, m1);
    for (; n < n1; ++n) tile_rows<V, 1, kC>(w, xq, sx, sw, bias, n, K, y, N, m0, m1);
  }
}
#endif

void check_linear_args(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& w_scale,
                       const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "int8_linear: x float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.size(1) == x.size(1),
              "int8_linear: w contiguous int8 [N, K] with x's K");
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.scalar_type() == torch::kFloat32 && w_scale.is_contiguous() &&
                  w_scale.size(0) == w.size(0),
              "int8_linear: w_scale contiguous float32 [N]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                        bias->size(0) == w.size(0)),
              "int8_linear: bias contiguous float32 [N]");
  TORCH_CHECK(x.size(1) < 133000, "int8_linear: K under 133000 (int32 sums)");
}

}  // namespace

std::vector<torch::Tensor> quantize_int8_per_token(torch::Tensor x, bool force_scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quantize_int8_per_token: x float32 [M, K]");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, xc.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, xc.options());
  quantize_rows(xc.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(), M, K, force_scalar);
  return {q, s};
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                          bool force_scalar) {
  check_linear_args(x, w, w_scale, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const torch::Tensor xc = x.contiguous();
  auto xq = torch::empty({M, K}, xc.options().dtype(torch::kInt8));
  auto sx = torch::empty({M}, xc.options());
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = sx.data_ptr<float>();
  quantize_rows(xc.data_ptr<float>(), qp, sp, M, K, force_scalar);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* swp = w_scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef __AVX2__
  if (!force_scalar) {
    const bool vnni = kHaveVnni && get_isa() == "avx512";
    at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
      if (vnni)
        gemm_range<kHaveVnni>(qp, sp, wp, swp, bp, yp, M, N, K, n0, n1);
      else
        gemm_range<false>(qp, sp, wp, swp, bp, yp, M, N, K, n0, n1);
    });
    return y;
  }
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = epilogue(dot_scalar(wp + n * K, qp + m * K, K), sp[m], swp[n], bp, n);
  });
  return y;
}
