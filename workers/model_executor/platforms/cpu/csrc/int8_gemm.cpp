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
// (decode): 4 weight rows at a time. From two rows, AVX2: tiles of 4 weight
// rows x 2 rows of x whose K loop is asm on fixed registers (8 sums, nothing
// spilled), |x| quantized once beside x, 4 outputs a row reduced and scaled
// together; x in chunks that stay in L2 while the weight tiles pass. VNNI:
// tiles of 4 x 4 rows (16 accumulators; the 1-3 rows left over in one smaller
// tile), x in chunks of 64 rows. Software prefetch fetches the next weight
// tile (short row streams the hardware prefetcher does not follow; as
// gguf_gemv.cpp).
// Measured (1 thread, Zen 4, shared machine: best of 15 interleaved rounds,
// 576 x 1536 and 1536 x 576, weights in cache): M = 1, 11-12 us (VNNI) and
// 12-14 us (AVX2), 3.1-3.4x faster than the float32 small_m_linear, 5.5-6x
// F.linear; M = 256, 166-199 GOP/s (VNNI), 1.35-1.65x small_m_linear, 2.2-2.5x
// F.linear; faster than gguf_linear's Q8_0 at 1, 64 and 256 rows (its
// per-block scales cost an fma a block). AVX2 GEMM (1 thread, Zen 3, per CPU
// second, M = 16..256): SmolLM2-135M's shapes 118-130 GOP/s, 61-68% of the
// vpmaddubsw+vpmaddwd peak (the 4x4 tile it replaced: 92-114), 2048 x 2048
// 125-133 (115-118); the sign trick's vpsignb is a fourth vector op a pair,
// which holds it near 80%. K = 8192 stays near 60% (both tiles).
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

// ------------------------------------------------------ AVX2 GEMM (M >= 2)
// Register tiles of 4 weight rows x 2 rows of x: 8 accumulators, the 4 weight
// vectors, |x| and x of one row and the ones make 16 ymm, so nothing spills
// (the 4 x 4 tile above spilled every accumulator each step). Per 32 bytes of
// K and pair: vpsignb, vpmaddubsw, vpmaddwd, vpaddd; |x| comes quantized
// beside x (pack_rows), not recomputed per tile. The 4 sums of a row of x
// reduce together and leave as one 4-float epilogue.

// Row m of q to xp + 2 * ld * m and its |q| (<= 127: no 0x80 to wrap) ld
// bytes on. ld = K rounded up to 64, plus 64: with K a multiple of 2048 the rows
// of x would share L1 sets with each other and with the weight rows.
int64_t packed_ld(int64_t K) { return (K + 63) / 64 * 64 + 64; }

void pack_rows(const int8_t* q, int8_t* xp, int64_t M, int64_t K) {
  const int64_t ld = packed_ld(K);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* src = q + m * K;
      int8_t* dst = xp + m * 2 * ld;
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ld + k), _mm256_abs_epi8(v));
      }
      for (; k < K; ++k) dst[k] = src[k], dst[ld + k] = static_cast<int8_t>(std::abs(src[k]));
    }
  });
}

// [sum a0, sum a1, sum a2, sum a3].
inline __m128i hsum4_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

constexpr int kTR = 4, kTC = 2;

// The 4 x 2 tile's K loop in asm: from the intrinsics GCC 12 copied every
// accumulator through a spare register each step and spilled one. Fixed
// registers: ymm0-7 the sums (x row c, weight row r at 4c + r), ymm8-11 the
// weight rows, ymm12 |x|, ymm13 a product, ymm14 the int16 ones. x, the sign
// source, is read from memory by vpsignb. PF: prefetch the next 4 weight rows.
#define I8_PAIR(acc, wreg, q) \
  "vpsignb " q ", %%ymm" #wreg ", %%ymm13\n\t"   \
  "vpmaddubsw %%ymm13, %%ymm12, %%ymm13\n\t"      \
  "vpmaddwd %%ymm14, %%ymm13, %%ymm13\n\t"        \
  "vpaddd %%ymm13, %%ymm" #acc ", %%ymm" #acc "\n\t"
#define I8_PREFETCH \
  "prefetcht0 (%[pn])\n\t"                        \
  "prefetcht0 (%[pn],%[K])\n\t"                   \
  "prefetcht0 (%[pn],%[K],2)\n\t"                 \
  "prefetcht0 (%[w3],%[K],4)\n\t"
#define I8_TILE_4X2(PREFETCH)                                                                     \
  asm volatile(                                                                                   \
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"                                                          \
      "vmovdqa %%ymm0, %%ymm1\n\tvmovdqa %%ymm0, %%ymm2\n\tvmovdqa %%ymm0, %%ymm3\n\t"            \
      "vmovdqa %%ymm0, %%ymm4\n\tvmovdqa %%ymm0, %%ymm5\n\tvmovdqa %%ymm0, %%ymm6\n\t"            \
      "vmovdqa %%ymm0, %%ymm7\n\t"                                                                \
      "vpcmpeqw %%ymm14, %%ymm14, %%ymm14\n\tvpsrlw $15, %%ymm14, %%ymm14\n\t"                    \
      "test %[n], %[n]\n\tjz 2f\n\t"                                                              \
      ".p2align 4\n"                                                                              \
      "1:\n\t"                                                                                    \
      "vmovdqu (%[w0]), %%ymm8\n\t"                                                               \
      "vmovdqu (%[w0],%[K]), %%ymm9\n\t"                                                          \
      "vmovdqu (%[w0],%[K],2), %%ymm10\n\t"                                                       \
      "vmovdqu (%[w3]), %%ymm11\n\t" PREFETCH                                                     \
      "vmovdqu (%[a0]), %%ymm12\n\t"                                                              \
      I8_PAIR(0, 8, "(%[q0])") I8_PAIR(1, 9, "(%[q0])") I8_PAIR(2, 10, "(%[q0])")                 \
      I8_PAIR(3, 11, "(%[q0])")                                                                   \
      "vmovdqu (%[a0],%[ldx]), %%ymm12\n\t"                                                         \
      I8_PAIR(4, 8, "(%[q0],%[ldx])") I8_PAIR(5, 9, "(%[q0],%[ldx])") I8_PAIR(6, 10, "(%[q0],%[ldx])")  \
      I8_PAIR(7, 11, "(%[q0],%[ldx])")                                                              \
      "add $32, %[w0]\n\tadd $32, %[w3]\n\tadd $32, %[pn]\n\tadd $32, %[q0]\n\tadd $32, %[a0]\n\t" \
      "dec %[n]\n\tjnz 1b\n"                                                                      \
      "2:\n\t"                                                                                    \
      "vmovdqu %%ymm0, (%[out])\n\tvmovdqu %%ymm1, 32(%[out])\n\t"                                \
      "vmovdqu %%ymm2, 64(%[out])\n\tvmovdqu %%ymm3, 96(%[out])\n\t"                              \
      "vmovdqu %%ymm4, 128(%[out])\n\tvmovdqu %%ymm5, 160(%[out])\n\t"                            \
      "vmovdqu %%ymm6, 192(%[out])\n\tvmovdqu %%ymm7, 224(%[out])\n\t"                            \
      : [w0] "+r"(w0), [w3] "+r"(w3), [pn] "+r"(pn), [q0] "+r"(q0), [a0] "+r"(a0), [n] "+r"(n)   \
      : [K] "r"(K), [ldx] "r"(ldx), [out] "r"(out)                                                \
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",   \
        "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14")

// sums[8 * (4c + r)]: the int32 lanes of row c of x against weight row r
// over the whole 32-byte steps of K.
void dot_4x2(const int8_t* w, const int8_t* q, const uint8_t* qa, int64_t K, int64_t ldx, bool pf, __m256i* sums) {
  const int8_t *w0 = w, *w3 = w + 3 * K, *pn = w + 4 * K, *q0 = q;
  const uint8_t* a0 = qa;
  int64_t n = K / kStep;
  int32_t* out = reinterpret_cast<int32_t*>(sums);
  if (pf)
    I8_TILE_4X2(I8_PREFETCH);
  else
    I8_TILE_4X2("");
}
#undef I8_TILE_4X2
#undef I8_PREFETCH
#undef I8_PAIR

// The same sums for the edge tiles (R < 4 weight rows, or one row of x).
template <int R, int C>
void dot_tile(const int8_t* w, const int8_t* q, const uint8_t* qa, int64_t K, int64_t ldx, bool pf,
              __m256i (&acc)[C][R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k + kStep <= K; k += kStep) {
    __m256i wv[R];
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
      if (pf && (k & 32) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * K + k), _MM_HINT_T0);
    }
    for (int c = 0; c < C; ++c) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + c * ldx + k));
      const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * ldx + k));
      for (int r = 0; r < R; ++r)
        acc[c][r] =
            _mm256_add_epi32(acc[c][r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(wv[r], s)), ones));
    }
  }
}

// R weight rows w (stride K, from row n) against C rows of x (q and |q|,
// row stride ldx); y rows stride N. pf: fetch the next R weight rows while
// these pass (the first x tile of a weight tile; the later ones find them
// in L1).
template <int R, int C>
void tile_avx2(const int8_t* w, const int8_t* q, const uint8_t* qa, int64_t ldx, const float* sx, const float* sw,
               const float* bias, int64_t n, int64_t K, float* y, int64_t N, bool pf) {
  __m256i acc[C][R];
  if constexpr (R == 4 && C == 2)
    dot_4x2(w, q, qa, K, ldx, pf, &acc[0][0]);
  else
    dot_tile<R, C>(w, q, qa, K, ldx, pf, acc);
  const int64_t k1 = K / kStep * kStep;
  for (int c = 0; c < C; ++c) {
    if constexpr (R == 4) {
      __m128i sum = hsum4_epi32(acc[c][0], acc[c][1], acc[c][2], acc[c][3]);
      if (k1 < K) {
        alignas(16) int32_t tail[4];
        for (int r = 0; r < 4; ++r) tail[r] = dot_scalar(w + r * K + k1, q + c * ldx + k1, K - k1);
        sum = _mm_add_epi32(sum, _mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
      }
      // epilogue() on 4 outputs: the same float operations, so the same bits.
      const __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(sum), _mm_set1_ps(sx[c]));
      const __m128 b = bias ? _mm_loadu_ps(bias + n) : _mm_setzero_ps();
      _mm_storeu_ps(y + c * N + n, _mm_fmadd_ps(v, _mm_loadu_ps(sw + n), b));
    } else {
      for (int r = 0; r < R; ++r) {
        const int32_t acc_rc = hsum_epi32(acc[c][r]) + dot_scalar(w + r * K + k1, q + c * ldx + k1, K - k1);
        y[c * N + n + r] = epilogue(acc_rc, sx[c], sw[n + r], bias, n + r);
      }
    }
  }
}

// Weight rows [n, n + R) against x rows [m0, m1): kTC rows at a time, an odd one last.
template <int R>
void tile_rows_avx2(const int8_t* w, const int8_t* q, const uint8_t* qa, int64_t ldx, const float* sx, const float* sw,
                    const float* bias, int64_t n, int64_t K, float* y, int64_t N, int64_t m0, int64_t m1) {
  const int8_t* wr = w + n * K;
  int64_t m = m0;
  for (; m + kTC <= m1; m += kTC)
    tile_avx2<R, kTC>(wr, q + m * ldx, qa + m * ldx, ldx, sx + m, sw, bias, n, K, y + m * N, N, m == m0);
  if (m < m1) tile_avx2<R, 1>(wr, q + m * ldx, qa + m * ldx, ldx, sx + m, sw, bias, n, K, y + m * N, N, m == m0);
}

// x rows in chunks whose q and |q| stay in L2 (about 128 KiB of the 512)
// while the thread's weight rows pass once per chunk.
void gemm_range_avx2(const int8_t* xp, const float* sx, const int8_t* w, const float* sw, const float* bias, float* y,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t ld = packed_ld(K);
  const int8_t* q = xp;
  const uint8_t* qa = reinterpret_cast<const uint8_t*>(xp + ld);
  const int64_t chunk = std::clamp<int64_t>((128 << 10) / (2 * ld) / kTC * kTC, kTC, 256);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    int64_t n = n0;
    for (; n + kTR <= n1; n += kTR) tile_rows_avx2<kTR>(w, q, qa, 2 * ld, sx, sw, bias, n, K, y, N, m0, m1);
    for (; n < n1; ++n) tile_rows_avx2<1>(w, q, qa, 2 * ld, sx, sw, bias, n, K, y, N, m0, m1);
  }
}

constexpr int kR = 4, kC = 4;
constexpr int64_t kChunk = 64;

// The GEMV (both ISAs) and the VNNI GEMM.
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
    torch::Tensor xp;  // q and |q| row by row, for the AVX2 GEMM
    if (!vnni && M > 1) {
      xp = torch::empty({M, 2 * packed_ld(K)}, xc.options().dtype(torch::kInt8));
      pack_rows(qp, xp.data_ptr<int8_t>(), M, K);
    }
    at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
      if (vnni)
        gemm_range<kHaveVnni>(qp, sp, wp, swp, bp, yp, M, N, K, n0, n1);
      else if (M > 1)
        gemm_range_avx2(xp.data_ptr<int8_t>(), sp, wp, swp, bp, yp, M, N, K, n0, n1);
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
