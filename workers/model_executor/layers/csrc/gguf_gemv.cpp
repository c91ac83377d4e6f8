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
// The dot products follow ggml_vec_dot_{q4_0_q8_0, q4_1_q8_1, q8_0_q8_0}'s
// AVX2 path: 8 int32 lanes per block pair, lane j the sum over values
// 4j..4j+3 (vpmaddubsw + vpmaddwd with ones on the AVX2 path, vpdpbusd on
// the AVX-512 VNNI one, which sums the same 4 bytes and so gives the same
// integers), then acc[j] = fma(d_w * d_x, float(lane j), acc[j]) over the
// blocks, one horizontal sum at the end (Q4_1 adds the sum of m * s over the
// blocks, an fma chain). The scalar path does exactly the same float
// operations in the same order, and so does every register tile below: the
// GEMV, the GEMM, the scalar path and the two ISA paths give the same bits
// (force_scalar picks the scalar path, set_isa / SHOAL_CPU_ISA=avx2 the
// AVX2 one; tests). As in llama.cpp, a Q8_0 weight of -128 (gguf never
// writes one) can saturate vpmaddubsw's int16 pair sums on the AVX2 path.
//
// Threads split the weight rows, in runs of whole 4-row tiles. One row of x
// (decode; the GEMV): four weight rows at a time (four independent
// accumulation chains: one chain is bound by the FMA's latency). From two
// rows (prefill, batched decode; the GEMM): tiles of 4 weight rows x 4 rows
// of x in registers, 16 accumulators, so each unpacked weight block serves
// 4 activation blocks and each activation block 4 weight blocks; x goes in
// chunks of 64 rows. Q4_0's (q - 8) y is summed as q y - 8 y, the second
// term once per activation block (the same integers as llama.cpp's sign
// trick, fewer instructions). Software prefetch runs two tiles ahead: the
// hardware prefetcher does not follow four short row streams.
// Measured (1 thread, Zen 4, SmolLM2's MLP shapes, M = 1, weights from
// memory): 15-17 GB/s of Q4 blocks, 30 GB/s of Q8_0 blocks, 2.4-3.2x the
// float32 small_m_linear's time per call. At 64-512 rows (1 thread, VNNI,
// weights in cache): 100-117 GFLOP/s-equivalent at Q4_0 / Q8_0, 1.1-1.45x
// MKL's float32 F.linear, and 1.2-1.6x the GEMV's; Q4_1 ~15% slower, 0.95-1.15x
// MKL (benchmarks/gguf_kernels.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// hsum256's order: (l[i] + l[i + 4]), then pairs, then the two halves.
inline float hsum8(const float l[8]) {
  const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
  return (s0 + s1) + (s2 + s3);
}

// One weight row (nb blocks) against one quantized activation row.
template <int T>
float dot_scalar(const uint8_t* w, const uint8_t* a, int64_t nb) {
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34, abb = T == kQ4_1 ? 36 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, summs = 0.f;
  int32_t lane[8];
  for (int64_t b = 0; b < nb; ++b, w += wbb, a += abb) {
    lanes_scalar<T>(w + wq, reinterpret_cast<const int8_t*>(a + aq), lane);
    const float d = fp16_load(w) * fp16_load(a);
    for (int j = 0; j < 8; ++j) acc[j] = std::fma(d, static_cast<float>(lane[j]), acc[j]);
    if (T == kQ4_1) summs = std::fma(fp16_load(w + 2), fp16_load(a + 2), summs);  // an fma on every path
  }
  return hsum8(acc) + summs;
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
// Four hsum256s at once, each in hsum8's order: (l[i] + l[i + 4]), pairs, halves.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const auto half = [](__m256 v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); };
  return _mm_hadd_ps(_mm_hadd_ps(half(a), half(b)), _mm_hadd_ps(half(c), half(d)));
}

// A register tile: R weight rows (row stride wrow bytes) against C rows of
// quantized x (stride arow), y[c * ldy + r] = row r . x row c. Each weight
// block is unpacked once for the C activation blocks, each activation block
// loaded once for the R weight blocks. Every (r, c) pair has its own
// accumulator and does one row's float operations in one row's order: the
// GEMV's (C = 1) and the scalar path's bits for any R and C.
// pf: prefetch the weight run two tiles on (the first call on a tile).
template <int T, bool V, int R, int C>
void tile(const uint8_t* w, int64_t wrow, const uint8_t* a, int64_t arow, int64_t nb, float* y, int64_t ldy,
          bool pf) {
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34, abb = T == kQ4_1 ? 36 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  constexpr int64_t kAhead = 2;  // tiles of R rows
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[R][C];
  float summs[R][C];
  __m128 summs4[R];  // Q4_1 at C = 4: the C min terms of row r in one vector
  for (int r = 0; r < R; ++r) {
    summs4[r] = _mm_setzero_ps();
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps(), summs[r][c] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ya[C], base[C];
    __m256 da[C];
    float sa[C], dx[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* ab = a + c * arow + b * abb;
      ya[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + aq));
      dx[c] = fp16_load(ab);
      da[c] = _mm256_set1_ps(dx[c]);
      if (T == kQ4_1) sa[c] = fp16_load(ab + 2);
      // Q4_0: sum (q - 8) y = sum q y - 8 sum y, lane by lane (exact integers):
      // start the lanes at -8 sum y, once per activation block for all R rows.
      if (T == kQ4_0) base[c] = _mm256_sub_epi32(zero, dpbusd<V>(zero, _mm256_set1_epi8(8), ya[c]));
      // Q8_0 with vpdpbusd: (y + 128) w - 128 w, y + 128 being unsigned; one
      // instruction a pair, and exact where AVX2's sign trick saturates.
      if (T == kQ8_0 && V) ya[c] = _mm256_xor_si256(ya[c], _mm256_set1_epi8(static_cast<char>(0x80)));
    }
    // The four s in one vector from registers (a 16-byte load of the four
    // floats just stored would stall on store forwarding).
    __m128 sa4 = _mm_setzero_ps(), da4 = _mm_setzero_ps();
    if constexpr (C == 4) da4 = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
    if constexpr (T == kQ4_1 && C == 4) sa4 = _mm_setr_ps(sa[0], sa[1], sa[2], sa[3]);
    if (pf && R > 1) {
      // R rows are R short streams that the hardware prefetcher does not
      // follow (measured: from memory, 3-5x slower than from cache); together
      // they are one contiguous run of R * wrow bytes: fetch it kAhead tiles on.
      const char* p = reinterpret_cast<const char*>(w + kAhead * R * wrow + b * R * wbb);
      for (int64_t o = 0; o < R * wbb; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + r * wrow + b * wbb;
      const float dws = fp16_load(wb);
      const __m256 dw = _mm256_set1_ps(dws);
      // C = 4: the four d_w * d_x in one multiply, each then broadcast (a
      // shuffle, off the ports the multiplies and FMAs share).
      __m256 dwda4 = _mm256_setzero_ps();
      if constexpr (C == 4) dwda4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(dws), da4));
      const float mw = T == kQ4_1 ? fp16_load(wb + 2) : 0.f;
      __m256i wv, wbase = zero;
      if (T == kQ8_0) {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + wq));
        if (V) wbase = _mm256_sub_epi32(zero, dpbusd<V>(zero, _mm256_set1_epi8(static_cast<char>(0x80)), wv));
      } else {
        wv = nibbles(wb + wq);
      }
      // s8 x s8 on AVX2: the sign of w moved onto y, so the unsigned operand is |w|.
      const __m256i wabs = T == kQ8_0 && !V ? _mm256_sign_epi8(wv, wv) : wv;
      for (int c = 0; c < C; ++c) {
        __m256i l;
        if (T == kQ4_0)
          l = dpbusd<V>(base[c], wv, ya[c]);
        else if (T == kQ4_1)
          l = dpbusd<V>(zero, wv, ya[c]);
        else if (V)
          l = dpbusd<V>(wbase, ya[c], wv);
        else
          l = dpbusd<V>(zero, wabs, _mm256_sign_epi8(ya[c], wv));
        __m256 d;
        if constexpr (C == 4)
          d = _mm256_permutevar8x32_ps(dwda4, _mm256_set1_epi32(c));
        else
          d = _mm256_mul_ps(dw, da[c]);
        acc[r][c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), acc[r][c]);
        if (T == kQ4_1 && C != 4) summs[r][c] = std::fma(mw, sa[c], summs[r][c]);
      }
      if (T == kQ4_1 && C == 4) summs4[r] = _mm_fmadd_ps(_mm_set1_ps(mw), sa4, summs4[r]);
    }
  }
  if (T == kQ4_1 && C == 4)
    for (int r = 0; r < R; ++r) _mm_storeu_ps(summs[r], summs4[r]);
  for (int c = 0; c < C; ++c) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      float s[4];
      _mm_storeu_ps(s, hsum4(acc[r][c], acc[r + 1][c], acc[r + 2][c], acc[r + 3][c]));
      for (int i = 0; i < 4; ++i) y[c * ldy + r + i] = s[i] + summs[r + i][c];
    }
    for (; r < R; ++r) y[c * ldy + r] = hsum256(acc[r][c]) + summs[r][c];
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

// The GEMM tile: 4 weight rows x 4 x rows (16 accumulators). Measured (1
// thread, Zen 4, both ISA paths): 4-15% faster than 4x2, 2x4, 4x3, 3x4, 4x6
// or 6x2. x rows go in chunks of kChunk, so a chunk's activation blocks stay
// in L2 while every weight tile of the thread passes over them (no measured
// difference from 16 to all rows at SmolLM2's sizes; it matters for wide K).
constexpr int kR = 4, kC = 4;
constexpr int64_t kChunk = 64;

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

template <int T>
void gemm(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, bool scalar) {
  const int64_t nb = K / kQK, wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
#ifdef __AVX2__
  if (!scalar) {
    const bool vnni = kHaveVnni && get_isa() == "avx512", big = M >= g_gemm_min_rows.load();
    // Threads take runs of whole 4-row tiles.
    at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * 4, n1 = std::min(N, t1 * 4);
      if (vnni)
        gemm_range<T, kHaveVnni>(xq, w, y, M, N, nb, n0, n1, big);
      else
        gemm_range<T, false>(xq, w, y, M, N, nb, n0, n1, big);
    });
    return;
  }
#endif
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
  const int64_t nb = K / kQK;
#ifdef __AVX2__
  const bool vnni = kHaveVnni && get_isa() == "avx512", big = M >= g_gemm_min_rows.load();
  if (vnni)
    gemm_range<T, kHaveVnni>(xq, w, y, M, N, nb, n0, n1, big);
  else
    gemm_range<T, false>(xq, w, y, M, N, nb, n0, n1, big);
#else
  const int64_t wrow = nb * weight_block_bytes(T), arow = gguf_act_row_bytes(T, K);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_scalar<T>(w + n * wrow, xq + m * arow, nb);
#endif
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
