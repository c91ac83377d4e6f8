// y = x W^T with W in GGUF's (llama.cpp's) 32-weight blocks, computed the
// way llama.cpp's CPU backend does: every row of x is quantized once, per
// block of 32, to 8 bits (block_q8_0, or block_q8_1 for Q4_1 weights), and
// each (weight block, activation block) pair is an integer dot product
// scaled by the two fp16 block scales, accumulated in float.
//
// The block layouts (ggml-common.h), all little-endian, 32 values a block:
//   Q4_0 (type 2), 18 bytes: fp16 d, 16 bytes of nibbles; value = (q - 8) * d
//   Q4_1 (type 3), 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; value = q * d + m
//   Q8_0 (type 8), 34 bytes: fp16 d, 32 int8; value = q * d
// Byte i of the nibbles holds value i in its low half and value 16 + i in
// its high half. The activation blocks:
//   block_q8_0, 34 bytes: fp16 d, 32 int8
//   block_q8_1, 36 bytes: fp16 d, fp16 s = d * sum(q), 32 int8
// An activation block is quantized as ggml-cpu's x86 quantize_row_q8_0/_1:
// d = amax / 127, q = round-to-nearest-even(x * (127 / amax)) (ggml's
// portable reference rounds with roundf, half away from zero, and scales by
// 1 / d: the two can differ on exact ties and in the last bit of the
// scale), s = d * sum(q) with d in float32 before the fp16 store.
//
// Each (weight block, activation block) pair is an exact integer sum of its
// 32 products (vpmaddubsw + vpmaddwd with ones on the AVX2 path, vpdpbusd
// on the AVX-512 VNNI one: the same integers), then
// acc = fma(d_w * d_x, float(sum), acc) over the blocks in order; Q4_1 adds
// the sum of m_w * s_x over the blocks, a second fma chain, at the end. One
// float update per block pair, as llama.cpp's repacked GEMM kernels
// (repack.cpp) do, not its vec_dot's 8 lane sums a row: that is what lets
// 16 pairs share one instruction below. The scalar
// path does the same float operations in the same order, and so does every
// tile: the GEMV, the GEMM, the packed GEMM, the scalar path and the two ISA
// paths give the same bits (force_scalar picks the scalar path, set_isa /
// SHOAL_CPU_ISA=avx2 the AVX2 one; tests). As in llama.cpp, a Q8_0 weight
// of -128 (gguf never writes one) can saturate vpmaddubsw's int16 pair sums
// on the AVX2 path.
//
// Threads split the weight rows, in runs of whole 16-row groups. One row of
// x (decode; the GEMV): four weight rows at a time, their lane sums reduced
// together (vphaddd) into one vector of four block sums. From two rows
// (batched decode): tiles of 4 weight rows x 4 rows of x, so each unpacked
// weight block serves 4 activation blocks and each activation block 4
// weight blocks. Q4_0's (q - 8) y is summed as q y - 8 y, the second term
// once per activation block. Software prefetch runs two tiles ahead: the
// hardware prefetcher does not follow four short row streams. From 4 rows
// (8x that for Q8_0) on an AVX-512 VNNI CPU, the packed GEMM (below): 16
// weight rows copied into vectors of 4 weights x 16 rows, so one vpdpbusd
// serves 16 rows and one fma 16 block pairs.
// Measured (1 thread, Zen 4, SmolLM2's shapes, benchmarks/gguf_kernels.py):
// at M = 1, 15-17 GB/s of Q4 blocks from memory; Q4_1 at 64-256 rows,
// 315-413 GFLOP/s-equivalent packed against 64-90 in the 4x4 tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2_math.h"
#include "cpu_kernels.h"
#include "gguf_fp16.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQK = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

inline int64_t weight_block_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0;
}

// fp16 -> float32 is fp16_load (gguf_fp16.h); float32 -> fp16 rounds to nearest even, as ggml's.
inline void fp16_store(uint8_t* p, float f) {
#ifdef __F16C__
  const uint16_t h = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  const uint16_t h = c10::Half(f).x;
#endif
  std::memcpy(p, &h, 2);
}

// ---------------------------------------------------------------- activations

// One block of 32 floats -> block_q8_0 (q8_1: block_q8_1).
void quantize_block_scalar(const float* x, uint8_t* out, bool q8_1) {
  float amax = 0.f;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
  int8_t* q = reinterpret_cast<int8_t*>(out + (q8_1 ? 4 : 2));
  int sum = 0;
  for (int j = 0; j < kQK; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));  // the default rounding mode: to nearest even
    sum += q[j];
  }
  fp16_store(out, d);
  if (q8_1) fp16_store(out + 2, d * static_cast<float>(sum));
}

#ifdef __AVX2__
void quantize_block_avx2(const float* x, uint8_t* out, bool q8_1) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 m = _mm256_andnot_ps(sign, v[0]);
  for (int i = 1; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
  const __m256 mul = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i)
    iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  fp16_store(out, d);
  if (q8_1) {
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
    fp16_store(out + 2, d * static_cast<float>(_mm_cvtsi128_si32(s4)));
  }
  // int32 -> int8 in order: the packs interleave 128-bit halves, the permute puts them back.
  const __m256i p01 = _mm256_packs_epi32(iv[0], iv[1]), p23 = _mm256_packs_epi32(iv[2], iv[3]);
  const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q8_1 ? 4 : 2)), p);
}
#endif

void quantize_row(const float* x, uint8_t* out, int64_t K, bool q8_1, bool scalar) {
  const int64_t bb = q8_1 ? 36 : 34;
  for (int64_t b = 0; b < K / kQK; ++b) {
#ifdef __AVX2__
    if (!scalar) {
      quantize_block_avx2(x + b * kQK, out + b * bb, q8_1);
      continue;
    }
#endif
    quantize_block_scalar(x + b * kQK, out + b * bb, q8_1);
  }
}

// ------------------------------------------------------------ dot products

// The 8 lane sums of one (weight block, activation block) pair: lane j sums
// values 4j..4j+3. w: the block's quants (after its scales), a: 32 int8.
template <int T>
inline void lanes_scalar(const uint8_t* w, const int8_t* a, int32_t lane[8]) {
  int32_t v[kQK];
  if (T == kQ8_0) {
    for (int i = 0; i < kQK; ++i) v[i] = static_cast<int8_t>(w[i]);
  } else {
    const int off = T == kQ4_0 ? 8 : 0;
    for (int i = 0; i < 16; ++i) {
      v[i] = (w[i] & 0x0F) - off;
      v[i + 16] = (w[i] >> 4) - off;
    }
  }
  for (int j = 0; j < 8; ++j)
    lane[j] = v[4 * j] * a[4 * j] + v[4 * j + 1] * a[4 * j + 1] + v[4 * j + 2] * a[4 * j + 2] + v[4 * j + 3] * a[4 * j + 3];
}

// One weight row (nb blocks) against one quantized activation row, in the
// order every path keeps: per block the exact integer sum, then
// acc = fma(d_w * d_x, float(sum), acc); Q4_1's m_w * s_x in a second fma
// chain, added at the end.
template <int T>
float dot_scalar(const uint8_t* w, const uint8_t* a, int64_t nb) {
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34, abb = T == kQ4_1 ? 36 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  float acc = 0.f, accm = 0.f;
  int32_t lane[8];
  for (int64_t b = 0; b < nb; ++b, w += wbb, a += abb) {
    lanes_scalar<T>(w + wq, reinterpret_cast<const int8_t*>(a + aq), lane);
    int32_t s = 0;
    for (int j = 0; j < 8; ++j) s += lane[j];
    acc = std::fma(fp16_load(w) * fp16_load(a), static_cast<float>(s), acc);
    if (T == kQ4_1) accm = std::fma(fp16_load(w + 2), fp16_load(a + 2), accm);
  }
  return T == kQ4_1 ? acc + accm : acc;
}

#ifdef __AVX2__
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif

// src + the u8 x s8 products, 4 adjacent ones summed into each int32 lane:
// vpdpbusd (V, AVX-512 VNNI) or vpmaddubsw + vpmaddwd with ones (AVX2). The
// same integers either way where vpmaddubsw's int16 pair sums do not
// saturate (every use here but a Q8_0 weight of -128 on the AVX2 path).
template <bool V>
inline __m256i dpbusd(__m256i src, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (V) return _mm256_dpbusd_epi32(src, u, s);
#endif
  return _mm256_add_epi32(src, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline __m256i nibbles(const uint8_t* q) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}
// The whole sums of four lane vectors: [sum a, sum b, sum c, sum d] (exact integers, any order).
inline __m128i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
inline int32_t reduce1(__m256i a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// A register tile on the blocks as stored: R weight rows (1 or 4, row
// stride wrow bytes) against C rows of quantized x (stride arow),
// y[c * ldy + r] = row r . x row c, with dot_scalar's float operations per
// (r, c) pair. Each weight block is unpacked once for the C activation
// blocks, each activation block loaded once for the R weight blocks.
// pf: prefetch the weight run two tiles on (the first call on a tile).
template <int T, bool V, int R, int C>
void tile(const uint8_t* w, int64_t wrow, const uint8_t* a, int64_t arow, int64_t nb, float* y, int64_t ldy,
          bool pf) {
  static_assert(R == 1 || R == 4);
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34, abb = T == kQ4_1 ? 36 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  constexpr int64_t kAhead = 2;  // tiles of R rows
  const __m256i zero = _mm256_setzero_si256();
  __m128 acc[C], accm[C];  // R = 4: lane r; R = 1: lane 0
  for (int c = 0; c < C; ++c) acc[c] = _mm_setzero_ps(), accm[c] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ya[C], base[C];
    float sa[C], dx[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* ab = a + c * arow + b * abb;
      ya[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + aq));
      dx[c] = fp16_load(ab);
      if (T == kQ4_1) sa[c] = fp16_load(ab + 2);
      // Q4_0: sum (q - 8) y = sum q y - 8 sum y: start the lanes at -8 sum y,
      // once per activation block for all R rows.
      if (T == kQ4_0) base[c] = _mm256_sub_epi32(zero, dpbusd<V>(zero, _mm256_set1_epi8(8), ya[c]));
      // Q8_0 with vpdpbusd: (w + 128) y - 128 y, w + 128 being unsigned.
      if (T == kQ8_0 && V)
        base[c] = _mm256_sub_epi32(zero, dpbusd<V>(zero, _mm256_set1_epi8(static_cast<char>(0x80)), ya[c]));
    }
    if (pf && R > 1) {
      // R rows are R short streams that the hardware prefetcher does not
      // follow (measured: from memory, 3-5x slower than from cache); together
      // they are one contiguous run of R * wrow bytes: fetch it kAhead tiles on.
      const char* p = reinterpret_cast<const char*>(w + kAhead * R * wrow + b * R * wbb);
      for (int64_t o = 0; o < R * wbb; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    __m256i wv[R], wabs[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + r * wrow + b * wbb;
      if (T == kQ8_0) {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + wq));
        if (V) wv[r] = _mm256_xor_si256(wv[r], _mm256_set1_epi8(static_cast<char>(0x80)));
      } else {
        wv[r] = nibbles(wb + wq);
      }
      // s8 x s8 on AVX2: the sign of w moved onto y, so the unsigned operand is |w|.
      wabs[r] = T == kQ8_0 && !V ? _mm256_sign_epi8(wv[r], wv[r]) : wv[r];
    }
    // The R rows' d (and Q4_1's m) as float32 lanes: their fp16 bits side by
    // side, converted at once (vcvtph2ps: fp16_load's values).
    __m128 dw4, mw4 = _mm_setzero_ps();
    {
      const uint8_t* wb = w + b * wbb;
      const uint8_t* w1 = wb + (R > 1 ? wrow : 0);
      const uint8_t* w2 = wb + (R > 1 ? 2 * wrow : 0);
      const uint8_t* w3 = wb + (R > 1 ? 3 * wrow : 0);
      if constexpr (T == kQ4_1) {
        int32_t dm[4];  // d and m of a row: 4 bytes
        std::memcpy(dm, wb, 4), std::memcpy(dm + 1, w1, 4), std::memcpy(dm + 2, w2, 4), std::memcpy(dm + 3, w3, 4);
        const __m128i h = _mm_setr_epi32(dm[0], dm[1], dm[2], dm[3]);  // d0 m0 d1 m1 ...
        const __m256 f = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        dw4 = _mm256_castps256_ps128(f);
        mw4 = _mm256_extractf128_ps(f, 1);
      } else {
        uint16_t d[4];
        std::memcpy(d, wb, 2), std::memcpy(d + 1, w1, 2), std::memcpy(d + 2, w2, 2), std::memcpy(d + 3, w3, 2);
        dw4 = _mm_cvtph_ps(_mm_setr_epi16(d[0], d[1], d[2], d[3], 0, 0, 0, 0));
      }
    }
    for (int c = 0; c < C; ++c) {
      __m256i l[R];
      for (int r = 0; r < R; ++r) {
        if (T == kQ4_0 || (T == kQ8_0 && V))
          l[r] = dpbusd<V>(base[c], wv[r], ya[c]);
        else if (T == kQ4_1)
          l[r] = dpbusd<V>(zero, wv[r], ya[c]);
        else
          l[r] = dpbusd<V>(zero, wabs[r], _mm256_sign_epi8(ya[c], wv[r]));
      }
      __m128i s;
      if constexpr (R == 4)
        s = reduce4(l[0], l[R > 1 ? 1 : 0], l[R > 2 ? 2 : 0], l[R > 3 ? 3 : 0]);
      else
        s = _mm_cvtsi32_si128(reduce1(l[0]));
      acc[c] = _mm_fmadd_ps(_mm_mul_ps(dw4, _mm_set1_ps(dx[c])), _mm_cvtepi32_ps(s), acc[c]);
      if (T == kQ4_1) accm[c] = _mm_fmadd_ps(mw4, _mm_set1_ps(sa[c]), accm[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float s[4], m[4];
    _mm_storeu_ps(s, acc[c]);
    _mm_storeu_ps(m, accm[c]);
    for (int r = 0; r < R; ++r) y[c * ldy + r] = T == kQ4_1 ? s[r] + m[r] : s[r];
  }
}

// The tiles of R weight rows from w (y's column n) against x rows [m0, m1):
// C rows at a time, then the 1 to 3 left over (C = 4) in one tile.
template <int T, bool V, int R, int C>
void tile_rows(const uint8_t* w, int64_t wrow, const uint8_t* xq, int64_t arow, int64_t nb, float* y, int64_t N,
               int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + C <= m1; m += C) tile<T, V, R, C>(w, wrow, xq + m * arow, arow, nb, y + m * N, N, m == m0);
  static_assert(C == 1 || C == 4);
  if constexpr (C == 4) {
    const uint8_t* a = xq + m * arow;
    const bool pf = m == m0;
    if (m1 - m == 3)
      tile<T, V, R, 3>(w, wrow, a, arow, nb, y + m * N, N, pf);
    else if (m1 - m == 2)
      tile<T, V, R, 2>(w, wrow, a, arow, nb, y + m * N, N, pf);
    else if (m1 - m == 1)
      tile<T, V, R, 1>(w, wrow, a, arow, nb, y + m * N, N, pf);
  }
}

// The GEMM tile: 4 weight rows x 4 x rows. x rows go in chunks of kChunk,
// so a chunk's activation blocks stay in L2 while every weight tile of the
// thread passes over them.
constexpr int kR = 4, kC = 4;
constexpr int64_t kChunk = 64;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The packed GEMM (AVX-512 VNNI, from g_packed_min_rows rows of x): 16
// weight rows at a time are first copied into a buffer where one 64-byte
// vector holds 4 consecutive weights of each of the 16 rows, so one
// vpdpbusd with 4 bytes of x broadcast adds 4 products to each of 16
// rows' block sums, and the block's float work (convert, scale, fma) is
// one instruction for 16 (row, x row) pairs where the 4x4 tile spends one
// on each. The same integers and float operations as dot_scalar, so its
// bits. Every type takes x + 128 as the unsigned operand and the weight as
// the signed one (Q4_0 as q - 8), and starts each block's sums at
// -128 * sum(w), kept with the copy.
constexpr int kPack = 16, kPackC = 8;

// One packed block of 16 rows: d (float32) [16], m [16] (Q4_1), -128 sum w
// (int32) [16], then 8 vectors of 4 weights x 16 rows (int8).
constexpr int64_t kPackedBlock = 64 * 3 + 64 * 8;

template <int T>
void pack16(const uint8_t* w, int64_t wrow, int64_t rows, int64_t nb, uint8_t* out) {
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2;
  if (rows < kPack) std::memset(out, 0, nb * kPackedBlock);  // rows past `rows`: zero weights, zero scales
  const __m128i low = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
  const __m128i eight = _mm_set1_epi8(8), flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * kPackedBlock;
    float* d = reinterpret_cast<float*>(o);
    float* m = d + 16;
    int32_t* base = reinterpret_cast<int32_t*>(o + 128);
    uint8_t* q = o + 192;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* wb = w + r * wrow + b * wbb;
      d[r] = fp16_load(wb);
      if (T == kQ4_1) m[r] = fp16_load(wb + 2);
      // Values 0..15 and 16..31 of the block, as bytes (Q4_0: q - 8), and their sum.
      __m128i v0, v1;
      int32_t sum;
      if (T == kQ8_0) {
        v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + wq));
        v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + wq + 16));
        // sum w = sum (w + 128) - 32 * 128, the unsigned sums by vpsadbw
        const __m128i s = _mm_add_epi64(_mm_sad_epu8(_mm_xor_si128(v0, flip), zero),
                                        _mm_sad_epu8(_mm_xor_si128(v1, flip), zero));
        sum = _mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 2) - 32 * 128;
      } else {
        const __m128i n = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + wq));
        v0 = _mm_and_si128(n, low);
        v1 = _mm_and_si128(_mm_srli_epi16(n, 4), low);
        const __m128i s = _mm_add_epi64(_mm_sad_epu8(v0, zero), _mm_sad_epu8(v1, zero));
        sum = _mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 2);
        if (T == kQ4_0) v0 = _mm_sub_epi8(v0, eight), v1 = _mm_sub_epi8(v1, eight), sum -= 32 * 8;
      }
      base[r] = -128 * sum;
      // Weights 4k..4k+3 of the row go to vector k, at the row's 4 bytes.
      int32_t g[8];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g), v0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(g + 4), v1);
      for (int k = 0; k < 8; ++k) std::memcpy(q + k * 64 + r * 4, &g[k], 4);
    }
  }
}

// C rows of x (x + 128 as bytes, xu, kQK a block; their d and s as float32,
// dx and sx, nb a row) against one packed group of 16 rows: y[c * ldy + r].
template <int T, int C>
void packed_tile(const uint8_t* pk, const uint8_t* xu, const float* dx, const float* sx, int64_t nb, float* y,
                 int64_t ldy, int64_t rows) {
  __m512 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps(), accm[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = pk + b * kPackedBlock;
    const __m512 d = _mm512_loadu_ps(o);
    const __m512i base = _mm512_loadu_si512(o + 128);
    __m512i wv[8];
    for (int k = 0; k < 8; ++k) wv[k] = _mm512_loadu_si512(o + 192 + 64 * k);
    for (int c = 0; c < C; ++c) {
      const int32_t* xb = reinterpret_cast<const int32_t*>(xu + (c * nb + b) * kQK);
      __m512i s = base;
      for (int k = 0; k < 8; ++k) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(xb[k]), wv[k]);
      const float dxc = dx[c * nb + b];
      acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dxc)), _mm512_cvtepi32_ps(s), acc[c]);
      if (T == kQ4_1)
        accm[c] = _mm512_fmadd_ps(_mm512_loadu_ps(o + 64), _mm512_set1_ps(sx[c * nb + b]), accm[c]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int c = 0; c < C; ++c)
    _mm512_mask_storeu_ps(y + c * ldy, keep, T == kQ4_1 ? _mm512_add_ps(acc[c], accm[c]) : acc[c]);
}

// x's activation blocks rows [0, M) as packed_tile reads them.
template <int T>
void unpack_activations(const uint8_t* xq, int64_t M, int64_t nb, uint8_t* xu, float* dx, float* sx) {
  constexpr int64_t abb = T == kQ4_1 ? 36 : 34;
  constexpr int aq = T == kQ4_1 ? 4 : 2;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < M * nb; ++i) {
    const uint8_t* ab = xq + i * abb;
    dx[i] = fp16_load(ab);
    sx[i] = T == kQ4_1 ? fp16_load(ab + 2) : 0.f;
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + aq));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xu + i * kQK), _mm256_xor_si256(q, flip));
  }
}

// Weight rows [n0, n1) against all M rows of x: the groups of 16 packed in
// turn (each packed once and used by every row of x), the 1 to 15 rows
// left over in the 4x4 tiles (the same bits).
template <int T>
void packed_range(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t nb, int64_t n0,
                  int64_t n1) {
  const int64_t wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
  thread_local std::vector<uint8_t> pk, xu;
  thread_local std::vector<float> dsx;
  pk.resize(nb * kPackedBlock);
  xu.resize(M * nb * kQK);
  dsx.resize(2 * M * nb);
  float *dx = dsx.data(), *sx = dsx.data() + M * nb;
  unpack_activations<T>(xq, M, nb, xu.data(), dx, sx);
  int64_t n = n0;
  for (; n + kPack <= n1; n += kPack) {
    pack16<T>(w + n * wrow, wrow, kPack, nb, pk.data());
    int64_t m = 0;
    for (; m + kPackC <= M; m += kPackC)
      packed_tile<T, kPackC>(pk.data(), xu.data() + m * nb * kQK, dx + m * nb, sx + m * nb, nb, y + m * N + n, N,
                             kPack);
    for (; m + 4 <= M; m += 4)
      packed_tile<T, 4>(pk.data(), xu.data() + m * nb * kQK, dx + m * nb, sx + m * nb, nb, y + m * N + n, N, kPack);
    for (; m < M; ++m)
      packed_tile<T, 1>(pk.data(), xu.data() + m * nb * kQK, dx + m * nb, sx + m * nb, nb, y + m * N + n, N, kPack);
  }
  for (; n + kR <= n1; n += kR) tile_rows<T, true, kR, kC>(w + n * wrow, wrow, xq, arow, nb, y + n, N, 0, M);
  for (; n < n1; ++n) tile_rows<T, true, 1, kC>(w + n * wrow, wrow, xq, arow, nb, y + n, N, 0, M);
}
constexpr bool kHavePacked = true;
#else
constexpr bool kHavePacked = false;
template <int T>
void packed_range(const uint8_t*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

template <int T, bool V>
void gemm_range(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t nb, int64_t n0,
                int64_t n1, bool gemm) {
  const int64_t wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
  if (!gemm) {  // the GEMV: four weight rows at a time, kept in L1 across the rows of x
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile_rows<T, V, 4, 1>(w + n * wrow, wrow, xq, arow, nb, y + n, N, 0, M);
    for (; n < n1; ++n) tile_rows<T, V, 1, 1>(w + n * wrow, wrow, xq, arow, nb, y + n, N, 0, M);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t m1 = std::min(M, m0 + kChunk);
    int64_t n = n0;
    for (; n + kR <= n1; n += kR) tile_rows<T, V, kR, kC>(w + n * wrow, wrow, xq, arow, nb, y + n, N, m0, m1);
    for (; n < n1; ++n) tile_rows<T, V, 1, kC>(w + n * wrow, wrow, xq, arow, nb, y + n, N, m0, m1);
  }
}
#endif

// From this many rows of x the GEMM tiles run: from 2 rows they take 0.6-0.8x
// the GEMV's time (1 thread, Zen 4); set_gguf_gemm_min_rows moves it (tests, benchmarks).
std::atomic<int64_t> g_gemm_min_rows{2};
// From this many rows the packed GEMM runs where the CPU has AVX-512 VNNI
// (Q8_0 from 8x as many: its copy costs twice Q4's a weight and its 4x4
// tiles run faster). Measured (1 thread, Zen 4, SmolLM2's shapes): Q4_1
// packed takes 0.9x the tiles' time at 4 rows, 0.5x at 8, 0.35x at 16,
// 0.2x from 64 (315-413 GFLOP/s-equivalent); Q8_0 on the 49152-row head
// 0.85x at 16, 0.36x at 64.
std::atomic<int64_t> g_packed_min_rows{4};

// The rows [n0, n1) of y on the widest path the ISA allows (all give the same bits).
template <int T>
void rows_range(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t nb, int64_t n0,
                int64_t n1) {
#ifdef __AVX2__
  const bool vnni = kHaveVnni && get_isa() == "avx512";
  if (vnni && kHavePacked && M >= g_packed_min_rows.load() * (T == kQ8_0 ? 8 : 1))
    packed_range<T>(xq, w, y, M, N, nb, n0, n1);
  else if (vnni)
    gemm_range<T, kHaveVnni>(xq, w, y, M, N, nb, n0, n1, M >= g_gemm_min_rows.load());
  else
    gemm_range<T, false>(xq, w, y, M, N, nb, n0, n1, M >= g_gemm_min_rows.load());
#else
  const int64_t wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_scalar<T>(w + n * wrow, xq + m * arow, nb);
#endif
}

template <int T>
void gemm(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, bool scalar) {
  const int64_t nb = K / kQK, wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
  if (!scalar) {
    // Threads take runs of whole 16-row groups (4-row tiles when N is small).
    const int64_t unit = N >= 64 ? 16 : 4;
    at::parallel_for(0, (N + unit - 1) / unit, 1, [&](int64_t t0, int64_t t1) {
      rows_range<T>(xq, w, y, M, N, nb, t0 * unit, std::min(N, t1 * unit));
    });
    return;
  }
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_scalar<T>(w + n * wrow, xq + m * arow, nb);
  });
}

torch::Tensor quantize_rows(const torch::Tensor& x, bool q8_1, bool scalar) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % kQK == 0,
              "quantize_q8_activations: x float32 [M, K], K a multiple of 32");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), row = K / kQK * (q8_1 ? 36 : 34);
  auto out = torch::empty({M, row}, xc.options().dtype(torch::kUInt8));
  const float* xp = xc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  // Rows are independent: split them when there are enough (16k values a chunk at least).
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, op + m * row, K, q8_1, scalar);
  });
  return out;
}

}  // namespace

// x: [M, K] float32 -> [M, K / 32 * 34] uint8 block_q8_0 rows (q8_1: [M, K / 32 * 36] block_q8_1).
torch::Tensor quantize_q8_activations(torch::Tensor x, bool q8_1, bool force_scalar) {
  return quantize_rows(x, q8_1, force_scalar);
}

int64_t set_gguf_gemm_min_rows(int64_t rows) { return g_gemm_min_rows.exchange(std::max<int64_t>(rows, 1)); }
int64_t set_gguf_packed_min_rows(int64_t rows) { return g_packed_min_rows.exchange(std::max<int64_t>(rows, 1)); }

// x: [M, K] float32; w_blocks: [N, K / 32 * block bytes] uint8 of ggml_type
// 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0) -> [M, N] float32.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w_blocks, int64_t ggml_type, bool force_scalar) {
  const int64_t bb = weight_block_bytes(ggml_type);
  TORCH_CHECK(bb > 0, "gguf_linear: ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), not ", ggml_type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % kQK == 0,
              "gguf_linear: x float32 [M, K], K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w_blocks.dim() == 2 && w_blocks.scalar_type() == torch::kUInt8 && w_blocks.is_contiguous() &&
                  w_blocks.size(1) == K / kQK * bb,
              "gguf_linear: w_blocks contiguous uint8 [N, K / 32 * ", bb, "]");
  const int64_t N = w_blocks.size(0);
  const torch::Tensor xq = quantize_rows(x, ggml_type == kQ4_1, force_scalar);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const uint8_t* wp = w_blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (ggml_type == kQ4_0)
    gemm<kQ4_0>(xp, wp, yp, M, N, K, force_scalar);
  else if (ggml_type == kQ4_1)
    gemm<kQ4_1>(xp, wp, yp, M, N, K, force_scalar);
  else
    gemm<kQ8_0>(xp, wp, yp, M, N, K, force_scalar);
  return y;
}

// The serial pieces of gguf_linear for the one-call decode step
// (cpu_decode_layers.cpp), which splits the work across its own threads:
// the same quantization and the same tiles, so the same bits.
int64_t gguf_act_row_bytes(int64_t ggml_type, int64_t K) { return K / kQK * (ggml_type == kQ4_1 ? 36 : 34); }

void gguf_quantize_rows(const float* x, uint8_t* out, int64_t K, int64_t ggml_type, int64_t m0, int64_t m1) {
  const int64_t row = gguf_act_row_bytes(ggml_type, K);
  for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, out + m * row, K, ggml_type == kQ4_1, false);
}

namespace {
template <int T>
void linear_rows_t(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
  rows_range<T>(xq, w, y, M, N, K / kQK, n0, n1);
}
}  // namespace

void gguf_linear_rows(const uint8_t* xq, const uint8_t* w, int64_t ggml_type, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int64_t n1) {
  if (ggml_type == kQ4_0)
    linear_rows_t<kQ4_0>(xq, w, y, M, N, K, n0, n1);
  else if (ggml_type == kQ4_1)
    linear_rows_t<kQ4_1>(xq, w, y, M, N, K, n0, n1);
  else
    linear_rows_t<kQ8_0>(xq, w, y, M, N, K, n0, n1);
}

int64_t gguf_weight_block_bytes(int64_t ggml_type) { return weight_block_bytes(ggml_type); }

// Rows `ids` of a Q8_0 or Q4_0 matrix as float32: gguf.py's dequantize of
// the rows an embedding lookup reads (d * q, d * (q - 8): one rounding, so
// its bits), without its dozen torch ops a decode step.
torch::Tensor gguf_embedding(torch::Tensor ids, torch::Tensor w_blocks, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kQ8_0 || ggml_type == kQ4_0, "gguf_embedding: ggml_type 8 (Q8_0) or 2 (Q4_0), not ",
              ggml_type);
  const int64_t bb = weight_block_bytes(ggml_type);
  TORCH_CHECK(w_blocks.dim() == 2 && w_blocks.is_contiguous() && w_blocks.scalar_type() == torch::kUInt8 &&
                  w_blocks.size(1) % bb == 0, "gguf_embedding: w_blocks contiguous uint8 [rows, whole blocks]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "gguf_embedding: int64 ids [n]");
  const torch::Tensor ic = ids.contiguous();
  const int64_t n = ic.numel(), rows = w_blocks.size(0), nb = w_blocks.size(1) / bb;
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "gguf_embedding: id out of range");
  auto out = torch::empty({n, nb * kQK}, ids.options().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = w_blocks.data_ptr<uint8_t>() + ip[i] * w_blocks.size(1);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      const float d = fp16_load(blk);
      float* o = op + (i * nb + b) * kQK;
      if (ggml_type == kQ8_0) {
        for (int j = 0; j < kQK; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
      } else {
        for (int j = 0; j < 16; ++j) {
          o[j] = d * static_cast<float>((blk[2 + j] & 0x0F) - 8);
          o[j + 16] = d * static_cast<float>((blk[2 + j] >> 4) - 8);
        }
      }
    }
  }
  return out;
}
