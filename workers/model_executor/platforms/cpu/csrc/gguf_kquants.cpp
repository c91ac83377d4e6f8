// y = x W^T with W in llama.cpp's K-quant super-blocks (256 weights), the
// way llama.cpp's CPU backend computes it: every row of x is quantized once
// to block_q8_K, and each (weight super-block, activation block) pair is an
// integer dot product with the sub-block scales, scaled by the float scales.
//
// The weight layouts (ggml-common.h), little-endian, 256 values a block:
//   Q4_K (type 12), 144 bytes: fp16 d, fp16 dmin, scales[12], qs[128]
//   Q5_K (type 13), 176 bytes: fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
//   Q6_K (type 14), 210 bytes: ql[128], qh[64], int8 scales[16], fp16 d
// Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale sc and min m (packed in
// scales[12] as get_scale_min_k4 reads them); value = d sc q - dmin m. 64
// values at a time: qs byte l holds value l (low nibble) and 32 + l (high);
// Q5_K adds bit 2j (low) or 2j+1 (high) of qh[l] as the 5th bit, 64-group j.
// Q6_K: 16 sub-blocks of 16 with an int8 scale; value = d sc (q - 32), q
// 6 bits: per half of 128, ql byte l / l + 32 give the low nibbles of values
// l, 32 + l (low halves) and 64 + l, 96 + l (high halves); qh byte l their
// top two bits, at bits 0, 2, 4, 6.
// block_q8_K, 292 bytes: float d, int8 qs[256], int16 bsums[16] (sums of 16).
// quantize_row_q8_K_ref: max = the value of largest magnitude (the first),
// iscale = -127 / max, q = min(127, round-half-even(iscale x)), d = 1 / iscale.
//
// Per (weight block, activation block): isum = sum_g sc_g dot_g(q, y) over
// 16-value groups g, exact in int32 (Q6_K's -32 as - 32 sum_g sc_g bsums_g),
// and Q4_K/Q5_K's msum = sum_g m_g bsums_g; then acc = fma(d_w d_y, isum,
// acc), accm = fma(dmin_w d_y, msum, accm) over the blocks, y = acc - accm.
// The integers are whole-block totals, so every path (scalar, AVX2 vpmaddubsw
// + vpmaddwd as ggml_vec_dot_q*_K_q8_K, AVX-512 vpdpbusd) gets the same ones
// and does the same float operations: equal bits on every path.
//
// Threads split the weight rows. The AVX2 path (all but Q6_K at one row)
// repacks each panel of 16 weight rows once per call so that a vector's
// lanes are weight rows, then runs every tile of x rows against it (see
// "panels" below). The scalar, AVX-512 and one-row AVX2 paths work in tiles
// of kRowsW rows: each weight block is unpacked (its quants to one byte a
// value in value order, its scales to vectors, kept in registers) once per
// pass of up to kRowsX rows of x and used against all of them; a tile runs
// every pass while it is in L1, so the weights are read from memory once and
// x's blocks come from L2. AVX-512 sums the lanes of 4 rows of x at once.
// Measured, AVX2 panels (1 thread, 2-core Zen 3 shared with other jobs,
// GOP/s per CPU second against the vpmaddubsw+vpmaddwd loop's ~191 a thread;
// Gemma-3-270M's shapes, N = 640, K = 1024 / 2048): Q4_K 35-38 at M = 1, 135
// (71%) at M = 16, 155 (81%) at 48, 160-165 (84-86%) at 256; Q6_K 67, 112,
// 125, 133 (70%) at M = 4, 16, 48, 256; 2-2.7x the one-row loop from M = 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "gguf_fp16.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KQ_AVX512 1
#endif

namespace {

constexpr int64_t kQK = 256, kQ8Bytes = 292;
constexpr int kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kRowsX = 16;  // x rows per pass: 16 of K = 1536 are 28 KB of blocks
// Weight rows per tile: a tile goes through every pass of x rows while it is
// in L1, so the weights are read from memory once (x's blocks come from L2).
constexpr int64_t kRowsW = 4;

inline int64_t block_bytes(int64_t type) {
  return type == kQ4_K ? 144 : type == kQ5_K ? 176 : type == kQ6_K ? 210 : 0;
}


enum Path { kScalar, kAvx2, kAvx512 };

Path pick_path(bool force_scalar) {
  if (force_scalar) return kScalar;
#ifdef KQ_AVX512
  if (get_isa() == "avx512") return kAvx512;
#endif
#ifdef __AVX2__
  return kAvx2;
#else
  return kScalar;
#endif
}

// ---------------------------------------------------------------- activations

// Quants and scale written, bsums from the quants (integers: one way for all paths).
void finish_block(int8_t* q, float d, uint8_t* out) {
  std::memcpy(out, &d, 4);
  std::memcpy(out + 4, q, kQK);
  int16_t bs[16];
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[16 * g + i];
    bs[g] = static_cast<int16_t>(s);
  }
  std::memcpy(out + 4 + kQK, bs, sizeof bs);
}

void quantize_block_scalar(const float* x, uint8_t* out) {
  float max = 0.f, amax = 0.f;
  for (int j = 0; j < kQK; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) amax = ax, max = x[j];
  }
  alignas(32) int8_t q[kQK] = {};
  float d = 0.f;
  if (amax != 0.f) {
    const float iscale = -127.f / max;
    for (int j = 0; j < kQK; ++j)  // nearbyint: the default mode, half to even, as ggml's nearest_int
      q[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * x[j]))));
    d = 1.f / iscale;
  }
  finish_block(q, d, out);
}

#ifdef __AVX2__
void quantize_block_avx2(const float* x, uint8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < kQK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  alignas(32) int8_t q[kQK] = {};
  float d = 0.f;
  if (amax != 0.f) {
    float max = 0.f;  // the first value of magnitude amax, as the scalar scan finds it
    const __m256 va = _mm256_set1_ps(amax);
    for (int i = 0; i < kQK; i += 8) {
      const int mask =
          _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), va, _CMP_EQ_OQ));
      if (mask) {
        max = x[i + __builtin_ctz(mask)];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m256 s = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int i = 0; i < kQK; i += 32) {
      __m256i v[4];
      for (int k = 0; k < 4; ++k)
        v[k] = _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_round_ps(
                                         _mm256_mul_ps(s, _mm256_loadu_ps(x + i + 8 * k)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      // int32 -> int8 in order: the packs interleave 128-bit halves, the permute puts them back.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + i),
                         _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    d = 1.f / iscale;
  }
  finish_block(q, d, out);
}
#endif

void quantize_range(const float* x, uint8_t* out, int64_t K, int64_t m0, int64_t m1, bool vector) {
  const int64_t nb = K / kQK;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kQK;
      uint8_t* ob = out + (m * nb + b) * kQ8Bytes;
#ifdef __AVX2__
      if (vector) {
        quantize_block_avx2(xb, ob);
        continue;
      }
#endif
      quantize_block_scalar(xb, ob);
    }
}

void quantize_rows(const float* x, uint8_t* out, int64_t M, int64_t K, bool vector) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) { quantize_range(x, out, K, m0, m1, vector); });
}

// ----------------------------------------------------------- weight blocks

// One weight super-block unpacked: quants one byte a value in value order
// (unsigned: Q6_K's -32 goes through bias), and per 16-value group g its
// scale and its bias factor (Q4_K/Q5_K: the min, into msum; Q6_K: 32 sc,
// subtracted from isum). The vector paths keep all of it in vectors, not
// bytes: they stay in registers across the rows of x, and a spill is
// reloaded at the width it was stored (a wider load than the stores that
// wrote it misses store forwarding: measured 2-3x slower at M = 1).
struct WBlock {
  alignas(64) uint8_t q[kQK];  // the scalar path's
  int16_t sc[16], bias[16];    // the scalar path's
  float d, dmin;
#ifdef __AVX2__
  __m256i qv[8];   // 32 values each
  __m256i scv[8];  // AVX2: chunk c's 16 int16 lanes (value pairs): sc[2c] x 8, sc[2c + 1] x 8
  __m256i biasv;
#endif
#ifdef KQ_AVX512
  __m512i qz[4];   // 64 values each
  __m512i scz[4];  // AVX-512: 64-value chunk k's 16 int32 lanes (value quads): int16 pair (sc[4k + i / 4], 0)
#endif
};

// get_scale_min_k4 for all 8 sub-blocks.
void scales_k4(const uint8_t* s, int16_t* sc, int16_t* mn) {
  for (int j = 0; j < 8; ++j) {
    int a, m;
    if (j < 4) {
      a = s[j] & 63, m = s[j + 4] & 63;
    } else {
      a = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    sc[2 * j] = sc[2 * j + 1] = static_cast<int16_t>(a);
    mn[2 * j] = mn[2 * j + 1] = static_cast<int16_t>(m);
  }
}

// Per 16-value group g its scale and bias factor, and the block's d and dmin.
template <int T>
void block_scales(const uint8_t* w, int16_t* sc, int16_t* bias, float& d, float& dmin) {
  if (T == kQ6_K) {
    for (int g = 0; g < 16; ++g) {
      sc[g] = static_cast<int8_t>(w[192 + g]);
      bias[g] = static_cast<int16_t>(32 * sc[g]);
    }
    d = fp16_load(w + 208), dmin = 0.f;
  } else {
    scales_k4(w + 4, sc, bias);
    d = fp16_load(w), dmin = fp16_load(w + 2);
  }
}

template <int T>
void unpack_scales(const uint8_t* w, WBlock& u) {
  block_scales<T>(w, u.sc, u.bias, u.d, u.dmin);
}

template <int T>
void unpack_quants_scalar(const uint8_t* w, uint8_t* q) {
  if (T == kQ6_K) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
      uint8_t* o = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        o[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
        o[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    return;
  }
  const uint8_t* qs = w + (T == kQ5_K ? 48 : 16);
  const uint8_t* qh = w + 16;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
      if (T == kQ5_K) {
        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      q[64 * j + l] = lo, q[64 * j + 32 + l] = hi;
    }
}

#ifdef __AVX2__
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The same bytes as unpack_quants_scalar, 32 at a time.
template <int T>
void unpack_quants_avx2(const uint8_t* w, __m256i* q) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto put = [&](int c, __m256i v) { q[c] = v; };
  if (T == kQ6_K) {
    const __m256i m2 = _mm256_set1_epi8(0x30);  // the top two bits in place
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(w + 64 * h), l1 = load256(w + 64 * h + 32), qh = load256(w + 128 + 32 * h);
      put(4 * h + 0, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)));
      put(4 * h + 1, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)));
      put(4 * h + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m2)));
      put(4 * h + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)));
    }
    return;
  }
  const uint8_t* qs = w + (T == kQ5_K ? 48 : 16);
  __m256i qh = T == kQ5_K ? load256(w + 16) : _mm256_setzero_si256();
  const __m256i bit = _mm256_set1_epi8(0x10);
  for (int j = 0; j < 4; ++j) {
    const __m256i b = load256(qs + 32 * j);
    __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    if (T == kQ5_K) {  // bit 2j of qh to bit 4 (shifted left by 4), then bit 2j + 1 (by 3)
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit));
      qh = _mm256_srli_epi16(qh, 2);
    }
    put(2 * j, lo), put(2 * j + 1, hi);
  }
}
#endif

#ifdef __AVX2__
// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (get_scale_min_k4 for all 8
// at once): bytes 0..7 the sub-block scales, 8..15 the mins.
inline __m128i scales_mins_k4(const uint8_t* w) {
  uint32_t t[4];
  std::memcpy(t, w + 4, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  t[3] = ((t[2] >> 4) & k2) | (((t[1] >> 6) & k3) << 4);
  const uint32_t m03 = t[1] & k1;
  t[1] = (t[2] & k2) | (((t[0] >> 6) & k3) << 4);
  t[2] = m03;
  t[0] &= k1;
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(t));
}

// The scales as int16 vectors, without a scalar loop (per block, for every
// weight row: at M = 1 this is a good part of the work). sc16: the 16 groups'
// scales (Q4_K/Q5_K: the 8 sub-block scales, each twice).
template <int T, Path P>
void unpack_scales_vec(const uint8_t* w, WBlock& u) {
  __m128i lo8, hi8;  // the scales of groups 0..7 and 8..15, one int16 each (Q4_K/Q5_K: 8 sub-blocks in lo8)
  if (T == kQ6_K) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    u.biasv = _mm256_slli_epi16(sc16, 5);
    lo8 = _mm256_castsi256_si128(sc16), hi8 = _mm256_extracti128_si256(sc16, 1);
    u.d = fp16_load(w + 208), u.dmin = 0.f;
  } else {
    const __m128i sm = scales_mins_k4(w);
    lo8 = _mm_cvtepu8_epi16(sm);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    u.biasv = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));
    hi8 = lo8;
    u.d = fp16_load(w), u.dmin = fp16_load(w + 2);
  }
  if (P == kAvx2) {
    // chunk c (32 values): Q4_K/Q5_K sub-block c in all 16 lanes; Q6_K group 2c in the low 8, 2c + 1 in the high 8
    for (int c = 0; c < 8; ++c) {
      const int lo = T == kQ6_K ? (2 * c) % 8 : c, hi = T == kQ6_K ? (2 * c + 1) % 8 : c;
      const __m256i src = _mm256_broadcastsi128_si256(T == kQ6_K && c >= 4 ? hi8 : lo8);
      const __m256i ctl = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0100 * (2 * hi + 1) + 2 * hi)),
                                           _mm_set1_epi16(static_cast<int16_t>(0x0100 * (2 * lo + 1) + 2 * lo)));
      u.scv[c] = _mm256_shuffle_epi8(src, ctl);
    }
  }
#ifdef KQ_AVX512
  if (P == kAvx512) {
    // int32 lane i of 64-value chunk k: (scale of value 64k + 4i, 0); Q4_K/Q5_K: sub-block 2k + i / 8
    const __m512i s32 = _mm512_cvtepu16_epi32(_mm256_set_m128i(hi8, lo8));
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = T == kQ6_K ? _mm512_setr_epi32(4 * k, 4 * k, 4 * k, 4 * k, 4 * k + 1, 4 * k + 1, 4 * k + 1,
                                                         4 * k + 1, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2,
                                                         4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3)
                                     : _mm512_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k,
                                                         2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                                         2 * k + 1, 2 * k + 1, 2 * k + 1);
      u.scz[k] = _mm512_permutexvar_epi32(idx, s32);
    }
  }
#endif
}
#endif

template <int T, Path P>
void unpack(const uint8_t* w, WBlock& u) {
  if (P == kScalar) {
    unpack_scales<T>(w, u);
    return unpack_quants_scalar<T>(w, u.q);
  }
#ifdef __AVX2__
  unpack_scales_vec<T, P>(w, u);
  unpack_quants_avx2<T>(w, u.qv);
#ifdef KQ_AVX512
  if (P == kAvx512)
    for (int k = 0; k < 4; ++k) u.qz[k] = _mm512_inserti64x4(_mm512_castsi256_si512(u.qv[2 * k]), u.qv[2 * k + 1], 1);
#endif
#endif
}

// ------------------------------------------------------------ dot products

// (isum, bias sum) of an unpacked weight block against an activation block.
struct ISums {
  int32_t isum, bsum;
};

inline ISums dot_scalar(const WBlock& u, const uint8_t* a) {
  const int8_t* y = reinterpret_cast<const int8_t*>(a + 4);
  int16_t bs[16];
  std::memcpy(bs, a + 4 + kQK, sizeof bs);
  int32_t isum = 0, bsum = 0;
  for (int g = 0; g < 16; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += u.q[16 * g + i] * y[16 * g + i];
    isum += u.sc[g] * s;
    bsum += u.bias[g] * bs[g];
  }
  return {isum, bsum};
}

#ifdef __AVX2__
// The totals of two int32 vectors.
inline ISums sums(__m256i a, __m256i b) {
  const __m256i h = _mm256_hadd_epi32(a, b);  // a01 a23 b01 b23 | a45 a67 b45 b67
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  s = _mm_hadd_epi32(s, s);
  return {_mm_cvtsi128_si32(s), _mm_extract_epi32(s, 1)};
}

// The lanes of isum and of the bias sum (summing each vector's lanes gives the totals).
inline void lanes_avx2(const WBlock& u, const uint8_t* a, __m256i& isum, __m256i& bsum) {
  const uint8_t* y = a + 4;
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    // u8 x s8 pairs (|sum| <= 2 * 63 * 127: no saturation), then the scales on the pairs
    const __m256i p = _mm256_maddubs_epi16(u.qv[c],
                                           load256(y + 32 * c));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, u.scv[c]));
  }
  isum = acc, bsum = _mm256_madd_epi16(load256(a + 4 + kQK), u.biasv);
}

inline ISums dot_avx2(const WBlock& u, const uint8_t* a) {
  __m256i i, b;
  lanes_avx2(u, a, i, b);
  return sums(i, b);
}

// The totals of 4 rows' (isum, bsum) lanes at once: isum4 and bsum4 hold row r in lane r.
inline void sums4(const __m256i* i, const __m256i* b, __m128i& isum4, __m128i& bsum4) {
  const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(i[0], i[1]), _mm256_hadd_epi32(i[2], i[3]));
  const __m256i hb = _mm256_hadd_epi32(_mm256_hadd_epi32(b[0], b[1]), _mm256_hadd_epi32(b[2], b[3]));
  isum4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  bsum4 = _mm_add_epi32(_mm256_castsi256_si128(hb), _mm256_extracti128_si256(hb, 1));
}
#endif

#ifdef KQ_AVX512
inline void lanes_avx512(const WBlock& u, const uint8_t* a, __m256i& isum, __m256i& bsum) {
  const uint8_t* y = a + 4;
  __m512i acc = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) {
    // 4-byte sums (|sum| <= 4 * 63 * 127 < 2^15), so the lane's low int16 times the scale is the product
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u.qz[k],
                                          _mm512_loadu_si512(y + 64 * k));
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(p, u.scz[k]));
  }
  isum = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  bsum = _mm256_madd_epi16(load256(a + 4 + kQK), u.biasv);
}

inline ISums dot_avx512(const WBlock& u, const uint8_t* a) {
  __m256i i, b;
  lanes_avx512(u, a, i, b);
  return sums(i, b);
}
#endif

template <Path P>
inline ISums dot(const WBlock& u, const uint8_t* a) {
#ifdef KQ_AVX512
  if (P == kAvx512) return dot_avx512(u, a);
#endif
#ifdef __AVX2__
  if (P == kAvx2) return dot_avx2(u, a);
#endif
  return dot_scalar(u, a);
}

#ifdef KQ_AVX512
// Rows m .. m + 3 of the pass at once: the same float operations, row by row,
// as the one-row loop, with the horizontal sums shared (AVX-512 only: on the
// AVX2 path the 4 rows' lanes spill, measured no faster at M = 64 and slower
// at M = 1 for the pressure it puts on the one-row loop).
template <int T>
inline void rows4(const WBlock& u, const uint8_t* a, int64_t arow, float* acc, float* accm) {
  __m256i i[4], b[4];
  for (int r = 0; r < 4; ++r) lanes_avx512(u, a + r * arow, i[r], b[r]);
  __m128i isum, bsum;
  sums4(i, b, isum, bsum);
  float dy[4];
  for (int r = 0; r < 4; ++r) std::memcpy(dy + r, a + r * arow, 4);
  const __m128 dy4 = _mm_loadu_ps(dy);
  if (T == kQ6_K) isum = _mm_sub_epi32(isum, bsum);
  _mm_storeu_ps(acc, _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(u.d), dy4), _mm_cvtepi32_ps(isum), _mm_loadu_ps(acc)));
  if (T != kQ6_K)
    _mm_storeu_ps(accm, _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(u.dmin), dy4), _mm_cvtepi32_ps(bsum), _mm_loadu_ps(accm)));
}
#endif

#ifdef __AVX2__
// ------------------------------------------ panels of 16 weight rows (AVX2)
//
// For batched rows of x the weights go in panels of 16 rows, repacked once
// per call into two groups of 8 so that int32 lane j of a vector is weight
// row j of its group: k-step t holds each row's values 4t .. 4t + 3, and a
// vpmaddubsw against the 4 bytes of one x row broadcast gives 8 rows'
// partial sums with no horizontal sums. kSteps steps are summed in int16
// before one vpmaddwd applies the rows' scales (exact: |sum| <= kSteps 2
// qmax 127 < 2^15), so most of the integer multiplies are the vpmaddubsw
// that do the work; a tile of kTileX x rows by both groups shares each load.
// The packing transposes the file's bytes in 4-byte words across 8 rows and
// then unpacks them bytewise as unpack_quants_avx2 does (its byte operations
// do not care where a byte sits). The integers are the same whole-block
// totals and the float operations the same, lane by lane: equal bits to the
// other paths.
constexpr int kGroup = 8;                 // weight rows a vector
constexpr int kNG = 2;                    // groups a panel
constexpr int64_t kPanel = kGroup * kNG;  // weight rows a panel
constexpr int kTileX = 3;                 // x rows a tile: 2 x 3 int16 and int32 sums in registers

template <int T>
constexpr int kGroups = T == kQ6_K ? 16 : 8;  // scale groups a block: 16 of 16 or 8 sub-blocks of 32
// Below this many rows of x the packing costs more than it saves: the one-row loop
// (measured: Q4_K gains 1.5x at one row, Q6_K loses 12% at one and gains from two).
template <int T>
constexpr int64_t kPanelMinRows = T == kQ6_K ? 2 : 1;
template <int T>
constexpr int kSteps = T == kQ4_K ? 8 : T == kQ5_K ? 4 : 2;  // 4-value steps summed in int16 (qmax 15, 31, 63)

template <int T>
struct PanelBlock {
  __m256i q[64][kNG];           // k-step t: row j's values 4t .. 4t + 3 in lane j
  __m256i sc[kGroups<T>][kNG];  // scale group g: row j's scale in int16 lanes 2j, 2j + 1
  __m256i bias[8][kNG];         // pair p: row j's bias factors of 16-groups 2p, 2p + 1 in int16 lanes 2j, 2j + 1
  __m256 d[kNG], dmin[kNG];
};

// r[t] lane j = the input r[j]'s lane t.
inline void transpose8x32(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x31);
  }
}

inline __m128i load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Per row (int32 lane j of a vector each): its 16 group scales as int16 pairs and its 8 bias pairs.
template <int T>
void pack_scales(const uint8_t* const* rows, int g, PanelBlock<T>& p) {
  auto pair = [](__m256i v) {  // int32 v -> int16 (v, v)
    return _mm256_or_si256(_mm256_blend_epi16(v, _mm256_setzero_si256(), 0xAA), _mm256_slli_epi32(v, 16));
  };
  __m256i s0[8], s1[8], b[8];
  alignas(16) uint16_t d16[kGroup], m16[kGroup];
  for (int j = 0; j < kGroup; ++j) {
    const uint8_t* w = rows[j];
    if (T == kQ6_K) {
      const __m128i s = load128(w + 192);
      s0[j] = pair(_mm256_cvtepi8_epi32(s)), s1[j] = pair(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)));
      b[j] = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s), 5);  // 32 sc: lane p = (32 sc 2p, 32 sc 2p + 1)
      std::memcpy(d16 + j, w + 208, 2), m16[j] = 0;
    } else {
      const __m128i sm = scales_mins_k4(w);
      s0[j] = pair(_mm256_cvtepu8_epi32(sm)), b[j] = pair(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
      std::memcpy(d16 + j, w, 2), std::memcpy(m16 + j, w + 2, 2);
    }
  }
  transpose8x32(s0), transpose8x32(b);
  if (T == kQ6_K) transpose8x32(s1);
  for (int i = 0; i < 8; ++i) {
    p.sc[i][g] = s0[i], p.bias[i][g] = b[i];
    if (T == kQ6_K) p.sc[8 + i][g] = s1[i];
  }
  p.d[g] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d16)));
  p.dmin[g] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(m16)));
}

// One block of each of 8 rows (rows[j]: row j's) into group g of p.
template <int T>
void pack_block(const uint8_t* const* rows, int g, PanelBlock<T>& p) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto words = [&](int at, __m256i* r) {
    for (int j = 0; j < kGroup; ++j) r[j] = load256(rows[j] + at);
    transpose8x32(r);
  };
  if (T == kQ6_K) {
    const __m256i m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      __m256i l0[8], l1[8], qh[8];
      words(64 * h, l0), words(64 * h + 32, l1), words(128 + 32 * h, qh);
      for (int t = 0; t < 8; ++t) {
        const int v = 32 * h + t;
        p.q[v][g] = _mm256_or_si256(_mm256_and_si256(l0[t], m4), _mm256_and_si256(_mm256_slli_epi16(qh[t], 4), m2));
        p.q[v + 8][g] =
            _mm256_or_si256(_mm256_and_si256(l1[t], m4), _mm256_and_si256(_mm256_slli_epi16(qh[t], 2), m2));
        p.q[v + 16][g] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0[t], 4), m4), _mm256_and_si256(qh[t], m2));
        p.q[v + 24][g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1[t], 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(qh[t], 2), m2));
      }
    }
  } else {
    const __m256i bit = _mm256_set1_epi8(0x10);
    __m256i qh[8];
    if (T == kQ5_K) words(16, qh);
    for (int j = 0; j < 4; ++j) {
      __m256i b[8];
      words((T == kQ5_K ? 48 : 16) + 32 * j, b);
      for (int t = 0; t < 8; ++t) {
        __m256i lo = _mm256_and_si256(b[t], m4), hi = _mm256_and_si256(_mm256_srli_epi16(b[t], 4), m4);
        if (T == kQ5_K) {  // as unpack_quants_avx2: bits 2j, 2j + 1 of qh
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh[t], 4), bit));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh[t], 3), bit));
          qh[t] = _mm256_srli_epi16(qh[t], 2);
        }
        p.q[16 * j + t][g] = lo, p.q[16 * j + 8 + t][g] = hi;
      }
    }
  }
  pack_scales<T>(rows, g, p);
}

inline __m256i bcast32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows of x (a: their blocks b, row stride arow) against the panel's block
// b: acc and accm as the one-row loop's, one lane a weight row.
template <int T, int R>
inline void tile_block(const PanelBlock<T>& p, const uint8_t* a, int64_t arow, __m256* acc, __m256* accm) {
  constexpr int S = kSteps<T>;
  __m256i isum[R][kNG], bsum[R][kNG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < kNG; ++g) isum[r][g] = bsum[r][g] = _mm256_setzero_si256();
  for (int c = 0; c < 64 / S; ++c) {
    __m256i s16[R][kNG];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < kNG; ++g) s16[r][g] = _mm256_setzero_si256();
    for (int s = 0; s < S; ++s) {
      const int t = c * S + s;
      for (int r = 0; r < R; ++r) {
        const __m256i y = bcast32(a + r * arow + 4 + 4 * t);
        for (int g = 0; g < kNG; ++g) s16[r][g] = _mm256_add_epi16(s16[r][g], _mm256_maddubs_epi16(p.q[t][g], y));
      }
    }
    const int sg = c * S * 4 * kGroups<T> / kQK;
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < kNG; ++g)
        isum[r][g] = _mm256_add_epi32(isum[r][g], _mm256_madd_epi16(s16[r][g], p.sc[sg][g]));
  }
  for (int i = 0; i < 8; ++i)  // bsums 2i, 2i + 1 of each x row against the rows' bias pairs
    for (int r = 0; r < R; ++r) {
      const __m256i y = bcast32(a + r * arow + 4 + kQK + 4 * i);
      for (int g = 0; g < kNG; ++g) bsum[r][g] = _mm256_add_epi32(bsum[r][g], _mm256_madd_epi16(p.bias[i][g], y));
    }
  for (int r = 0; r < R; ++r) {
    float dy;
    std::memcpy(&dy, a + r * arow, 4);
    const __m256 vdy = _mm256_set1_ps(dy);
    for (int g = 0; g < kNG; ++g) {
      __m256* o = acc + r * kNG + g;
      if (T == kQ6_K) isum[r][g] = _mm256_sub_epi32(isum[r][g], bsum[r][g]);
      *o = _mm256_fmadd_ps(_mm256_mul_ps(p.d[g], vdy), _mm256_cvtepi32_ps(isum[r][g]), *o);
      if (T != kQ6_K)
        accm[r * kNG + g] = _mm256_fmadd_ps(_mm256_mul_ps(p.dmin[g], vdy), _mm256_cvtepi32_ps(bsum[r][g]),
                                            accm[r * kNG + g]);
    }
  }
}

// R rows of x (x: their first, row stride arow) times a packed panel of nv <= 16 weight rows into y.
template <int T, int R>
void tile(const PanelBlock<T>* pb, int64_t nb, const uint8_t* x, int64_t arow, float* y, int64_t ldy, int64_t nv) {
  __m256 acc[R * kNG], accm[R * kNG];
  for (int i = 0; i < R * kNG; ++i) acc[i] = accm[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) tile_block<T, R>(pb[b], x + b * kQ8Bytes, arow, acc, accm);
  for (int r = 0; r < R; ++r) {
    alignas(32) float o[kPanel];
    for (int g = 0; g < kNG; ++g) _mm256_store_ps(o + kGroup * g, _mm256_sub_ps(acc[r * kNG + g], accm[r * kNG + g]));
    std::copy(o, o + nv, y + r * ldy);
  }
}

// The last rem < kTileX rows of x: one tile of rem rows.
template <int T, int R>
void tail(int64_t rem, const PanelBlock<T>* pb, int64_t nb, const uint8_t* x, int64_t arow, float* y, int64_t ldy,
          int64_t nv) {
  if constexpr (R > 0) {
    if (rem == R) return tile<T, R>(pb, nb, x, arow, y, ldy, nv);
    tail<T, R - 1>(rem, pb, nb, x, arow, y, ldy, nv);
  }
}

// Weight rows [n0, n1) of y = x W^T in panels: each packed once, then every tile of x rows.
template <int T>
void gemm_range_panels(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
                       int64_t n1) {
  static const uint8_t zero_block[256] = {};  // rows past n1: all-zero blocks (d = 0)
  const int64_t nb = K / kQK, bb = block_bytes(T), wrow = nb * bb, arow = nb * kQ8Bytes;
  std::vector<PanelBlock<T>> pb(nb);
  for (int64_t nt = n0; nt < n1; nt += kPanel) {
    const int64_t nv = std::min(kPanel, n1 - nt);
    for (int64_t b = 0; b < nb; ++b)
      for (int g = 0; g < kNG; ++g) {
        const uint8_t* rows[kGroup];
        for (int j = 0; j < kGroup; ++j) {
          const int64_t n = kGroup * g + j;
          rows[j] = n < nv ? w + (nt + n) * wrow + b * bb : zero_block;
        }
        pack_block<T>(rows, g, pb[b]);
      }
    int64_t m = 0;
    for (; m + kTileX <= M; m += kTileX) tile<T, kTileX>(pb.data(), nb, xq + m * arow, arow, y + m * ldy + nt, ldy, nv);
    tail<T, kTileX - 1>(M - m, pb.data(), nb, xq + m * arow, arow, y + m * ldy + nt, ldy, nv);
  }
}
#endif

// Weight rows [n0, n1) of y (row stride ldy) = x W^T, x already quantized.
template <int T, Path P>
void gemm_range(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
                int64_t n1) {
#ifdef __AVX2__
  if (P == kAvx2 && M >= kPanelMinRows<T>) return gemm_range_panels<T>(xq, w, y, ldy, M, K, n0, n1);
#endif
  const int64_t nb = K / kQK, bb = block_bytes(T), wrow = nb * bb, arow = nb * kQ8Bytes;
  WBlock u;
  float acc[kRowsX], accm[kRowsX];
  for (int64_t nt = n0; nt < n1; nt += kRowsW) {
    const int64_t nt1 = std::min(n1, nt + kRowsW);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsX) {
      const int64_t mb = std::min(kRowsX, M - m0);
      const uint8_t* x0 = xq + m0 * arow;
      for (int64_t n = nt; n < nt1; ++n) {
        std::fill(acc, acc + mb, 0.f), std::fill(accm, accm + mb, 0.f);
        for (int64_t b = 0; b < nb; ++b) {
          unpack<T, P>(w + n * wrow + b * bb, u);
          int64_t m = 0;
#ifdef KQ_AVX512
          if (P == kAvx512)
            for (; m + 4 <= mb; m += 4) rows4<T>(u, x0 + m * arow + b * kQ8Bytes, arow, acc + m, accm + m);
#endif
          for (; m < mb; ++m) {
            const uint8_t* a = x0 + m * arow + b * kQ8Bytes;
            ISums s = dot<P>(u, a);
            float dy;
            std::memcpy(&dy, a, 4);
            if (T == kQ6_K) s.isum -= s.bsum;  // sum sc (q - 32) y
            acc[m] = std::fma(u.d * dy, static_cast<float>(s.isum), acc[m]);
            if (T != kQ6_K) accm[m] = std::fma(u.dmin * dy, static_cast<float>(s.bsum), accm[m]);
          }
        }
        for (int64_t m = 0; m < mb; ++m) y[(m0 + m) * ldy + n] = acc[m] - accm[m];
      }
    }
  }
}

template <int T, Path P>
void gemm(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX2__
  if (P == kAvx2 && M >= kPanelMinRows<T>) {  // whole panels a thread
    const int64_t panels = (N + kPanel - 1) / kPanel;
    return at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      gemm_range_panels<T>(xq, w, y, N, M, K, p0 * kPanel, std::min(N, p1 * kPanel));
    });
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemm_range<T, P>(xq, w, y, N, M, K, n0, n1); });
}

template <int T>
void gemm_path(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, Path path) {
#ifdef KQ_AVX512
  if (path == kAvx512) return gemm<T, kAvx512>(xq, w, y, M, N, K);
#endif
#ifdef __AVX2__
  if (path == kAvx2) return gemm<T, kAvx2>(xq, w, y, M, N, K);
#endif
  gemm<T, kScalar>(xq, w, y, M, N, K);
}

template <int T>
void range_path(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t K, int64_t n0,
                int64_t n1, Path path) {
#ifdef KQ_AVX512
  if (path == kAvx512) return gemm_range<T, kAvx512>(xq, w, y, ldy, M, K, n0, n1);
#endif
#ifdef __AVX2__
  if (path == kAvx2) return gemm_range<T, kAvx2>(xq, w, y, ldy, M, K, n0, n1);
#endif
  gemm_range<T, kScalar>(xq, w, y, ldy, M, K, n0, n1);
}

void check_x(const torch::Tensor& x, const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % kQK == 0, who,
              ": x float32 [M, K], K a multiple of 256");
}

torch::Tensor quantize(const torch::Tensor& x, Path path) {
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto out = torch::empty({M, K / kQK * kQ8Bytes}, xc.options().dtype(torch::kUInt8));
  quantize_rows(xc.data_ptr<float>(), out.data_ptr<uint8_t>(), M, K, path != kScalar);
  return out;
}

}  // namespace

// x: [M, K] float32 -> [M, K / 256 * 292] uint8 block_q8_K rows.
torch::Tensor quantize_q8_k_activations(torch::Tensor x, bool force_scalar) {
  check_x(x, "quantize_q8_k_activations");
  return quantize(x, pick_path(force_scalar));
}

// x: [M, K] float32; w_blocks: [N, K / 256 * block bytes] uint8 of ggml_type
// 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K) -> [M, N] float32.
torch::Tensor gguf_linear_k(torch::Tensor x, torch::Tensor w_blocks, int64_t ggml_type, bool force_scalar) {
  const int64_t bb = block_bytes(ggml_type);
  TORCH_CHECK(bb > 0, "gguf_linear_k: ggml_type 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), not ", ggml_type);
  check_x(x, "gguf_linear_k");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w_blocks.dim() == 2 && w_blocks.scalar_type() == torch::kUInt8 && w_blocks.is_contiguous() &&
                  w_blocks.size(1) == K / kQK * bb,
              "gguf_linear_k: w_blocks contiguous uint8 [N, K / 256 * ", bb, "]");
  const int64_t N = w_blocks.size(0);
  const Path path = pick_path(force_scalar);
  const torch::Tensor xq = quantize(x, path);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const uint8_t* wp = w_blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (ggml_type == kQ4_K)
    gemm_path<kQ4_K>(xp, wp, yp, M, N, K, path);
  else if (ggml_type == kQ5_K)
    gemm_path<kQ5_K>(xp, wp, yp, M, N, K, path);
  else
    gemm_path<kQ6_K>(xp, wp, yp, M, N, K, path);
  return y;
}

// The serial pieces of gguf_linear_k for the one-call decode step, which
// splits rows across its own threads: the same path, blocks and tiles as
// gguf_linear_k picks unforced, so the same bits.
int64_t gguf_k_block_bytes(int64_t ggml_type) { return block_bytes(ggml_type); }

int64_t gguf_k_act_row_bytes(int64_t K) { return K / kQK * kQ8Bytes; }

void gguf_k_quantize_rows(const float* x, uint8_t* out, int64_t K, int64_t m0, int64_t m1) {
  quantize_range(x, out, K, m0, m1, pick_path(false) != kScalar);
}

void gguf_k_linear_rows(const uint8_t* xq, const uint8_t* w, int64_t ggml_type, float* y, int64_t ldy, int64_t M,
                        int64_t K, int64_t n0, int64_t n1) {
  const Path path = pick_path(false);
  if (ggml_type == kQ4_K)
    range_path<kQ4_K>(xq, w, y, ldy, M, K, n0, n1, path);
  else if (ggml_type == kQ5_K)
    range_path<kQ5_K>(xq, w, y, ldy, M, K, n0, n1, path);
  else
    range_path<kQ6_K>(xq, w, y, ldy, M, K, n0, n1, path);
}
