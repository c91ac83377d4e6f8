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
// 32 products (vpdpbusd on the AVX-512 VNNI path, vpmaddubsw + vpmaddwd
// with ones on the AVX2 one: the same integers), then
// acc = fma(d_w * d_x, float(sum), acc) over the blocks in order; Q4_1 adds
// the sum of m_w * s_x over the blocks, a second fma chain, at the end. One
// float update per block pair, as llama.cpp's repacked GEMM kernels
// (repack.cpp) do, not its vec_dot's 8 lane sums a row: that is what lets
// 16 pairs share one instruction. The scalar path does the same float
// operations in the same order, and so does every tile: one row of x or 4,
// the packed groups or the rows as stored, the scalar path and the two ISA
// paths give the same bits (force_scalar picks the scalar path, set_isa /
// SHOAL_CPU_ISA=avx2 the AVX2 one; tests).
//
// gguf_linear takes its weights packed by gguf_pack (groups of 16 rows, see
// "packed groups" below); the N % 16 rows after the last group stay as
// stored and take tiles of 4 weight rows x 1 or 4 rows of x. Threads split
// the weight rows in whole groups. Q4_0 and Q4_1 from 2 rows of x on AVX2
// (group_tile_xb, groups_xb): each thread takes its groups in blocks of
// about kGroupBlockBytes (in L2), each block against tiles of 6 rows of x,
// the blocks of K in chunks whose x, each 4 bytes broadcast to 32 once a
// chunk (kXbBytes, in L1), is vpmaddubsw's memory operand: no broadcast
// instruction a product. Q8_0 and the AVX-512 VNNI path: the rows of x in
// cache-blocking runs of about kXRunBytes of quantized x (in L2), each run
// against all of the thread's groups (a group, 6-11 KB at K = 576, stays in
// L1 for the run's tiles), a tile one group x 4 rows of x on AVX2 (16 ymm:
// 8 weight vectors + 4 accumulators), 8 rows of x on AVX-512 VNNI (32 zmm).
// One row of x (the GEMV, M = 1) and the rows left over: 1-row tiles.
// Every (weight row, x row) pair does the same float operations in the same
// order whatever the tile, chunk, run, thread count or path: bit-identical
// results (tests).
//
// Measured (AVX2 Zen 3 EPYC, 2 cores shared with other jobs; one thread,
// GOP/s per thread CPU second, best of 4 windows, the old build and the new
// in one process alternating; SmolLM2-135M shapes K = 576 / 1536, N = 192 /
// 576 / 1536 / 49152): this machine's int8 roofline (`shoal bench
// roofline`, vpmaddubsw + vpmaddwd) is about 192 GOP/s a core (int16
// accumulation, vpmaddubsw + vpaddw, about 320). Q4_1 from 16 rows of x
// 126-153 GOP/s (66-80% of 192; 113-133 with the 4-row tiles on
// vpbroadcastd), Q4_0 150-160; Q8_0 80-100 (42-52%: 16 multiplies per 256
// products, the sign moved onto x); one row of x unchanged, 45-85 GOP/s
// (bandwidth-bound). On Zen 4 (before this tiling): one row of x, 18-21
// GB/s of Q4 blocks from memory, 25 GB/s of Q8_0.
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

// A type's blocks: weight block bytes (wbb) and where its quants start (wq);
// the activation block's (abb, aq: block_q8_1 for Q4_1, else block_q8_0);
// where a packed block's quants start (qoff, see "packed groups").
template <int T>
struct Layout {
  static constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34;
  static constexpr int64_t abb = T == kQ4_1 ? 36 : 34;
  static constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  static constexpr int64_t qoff = T == kQ4_1 ? 64 : 32;
};

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
  constexpr int64_t wbb = Layout<T>::wbb, abb = Layout<T>::abb;
  constexpr int wq = Layout<T>::wq, aq = Layout<T>::aq;
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
// src + the u8 x s8 products, 4 adjacent ones summed into each int32 lane:
// vpdpbusd (V, AVX-512 VNNI) or vpmaddubsw + vpmaddwd with ones (AVX2). The
// same integers either way where vpmaddubsw's int16 pair sums do not
// saturate (here |u| <= 128 and |s| <= 127: they cannot).
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
  constexpr int64_t wbb = Layout<T>::wbb, abb = Layout<T>::abb;
  constexpr int wq = Layout<T>::wq, aq = Layout<T>::aq;
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

// The tail rows (N % 16, kept as stored): tiles of R weight rows against
// rows [0, M) of x, C rows of x at a time (C = 4, then the 1 to 3 left over).
template <int T, bool V, int R, int C>
void tail_tiles(const uint8_t* w, int64_t wrow, const uint8_t* xq, int64_t arow, int64_t nb, float* y, int64_t ldy,
                int64_t M) {
  int64_t m = 0;
  for (; m + C <= M; m += C) tile<T, V, R, C>(w, wrow, xq + m * arow, arow, nb, y + m * ldy, ldy, m == 0);
  static_assert(C == 1 || C == 4);
  if constexpr (C == 4) {
    const uint8_t* a = xq + m * arow;
    if (M - m == 3)
      tile<T, V, R, 3>(w, wrow, a, arow, nb, y + m * ldy, ldy, m == 0);
    else if (M - m == 2)
      tile<T, V, R, 2>(w, wrow, a, arow, nb, y + m * ldy, ldy, m == 0);
    else if (M - m == 1)
      tile<T, V, R, 1>(w, wrow, a, arow, nb, y + m * ldy, ldy, m == 0);
  }
}
#endif

// ------------------------------------------------------------ packed groups
//
// gguf_pack, at load, rewrites each run of 16 weight rows (a group; the
// N % 16 rows after the last group stay as stored) block by block so that
// one 64-byte vector holds 4 consecutive weights of each of the 16 rows:
// with 4 bytes of a row of x broadcast, one vpdpbusd adds 4 products to each
// of 16 rows' block sums, and the block's float work (convert, scale, fma)
// is one instruction for 16 (weight row, x row) pairs where tiles on the
// stored rows spend one on each. The same bytes, moved: block b of a group
// is 16 blocks' worth at the group's offset + b * 16 * block bytes, as
//   fp16 d [16] | Q4_1: fp16 m [16] | quants
// with the quants Q4_0 / Q4_1: 4 vectors, vector p lane i = row i's nibble
// bytes 4p..4p+3 (low nibbles values 4p.., high ones 16 + 4p..); Q8_0: 8
// vectors, vector k lane i = row i's values 4k..4k+3, + 128 (unsigned).
// The weight is vpdpbusd's unsigned operand: Q4 nibbles (q, with Q4_0's
// -8 sum x taken off once per activation block), Q8_0 w + 128 (-128 sum x).
// Measured (1 thread, Zen 4, SmolLM2's shapes, weights in cache): 300-410
// GFLOP/s-equivalent from 64 rows of x, 3-5x the tiles on the stored rows.
constexpr int kGroup = 16;

// Rows [0, 16) of w (stride wrow, as stored) -> one packed group.
template <int T>
void pack_group(const uint8_t* w, int64_t wrow, int64_t nb, uint8_t* out) {
  constexpr int64_t wbb = Layout<T>::wbb, qo = Layout<T>::qoff;
  constexpr int wq = Layout<T>::wq;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * kGroup * wbb;
    for (int i = 0; i < kGroup; ++i) {
      const uint8_t* wb = w + i * wrow + b * wbb;
      std::memcpy(o + 2 * i, wb, 2);
      if (T == kQ4_1) std::memcpy(o + 32 + 2 * i, wb + 2, 2);
      for (int k = 0; k < (T == kQ8_0 ? 8 : 4); ++k)
        for (int j = 0; j < 4; ++j) o[qo + 64 * k + 4 * i + j] = wb[wq + 4 * k + j] ^ (T == kQ8_0 ? 0x80 : 0);
    }
  }
}

// Row i of a packed group, block b, as stored (the inverse of pack_group).
template <int T>
void unpack_block(const uint8_t* group, int i, int64_t b, uint8_t* wb) {
  constexpr int64_t wbb = Layout<T>::wbb, qo = Layout<T>::qoff;
  constexpr int wq = Layout<T>::wq;
  const uint8_t* o = group + b * kGroup * wbb;
  std::memcpy(wb, o + 2 * i, 2);
  if (T == kQ4_1) std::memcpy(wb + 2, o + 32 + 2 * i, 2);
  for (int k = 0; k < (T == kQ8_0 ? 8 : 4); ++k)
    for (int j = 0; j < 4; ++j) wb[wq + 4 * k + j] = o[qo + 64 * k + 4 * i + j] ^ (T == kQ8_0 ? 0x80 : 0);
}

// Per activation block of x, what the packed tiles take besides the quants:
// d as float32, and Q4_1's s (float32) or the correction that starts the
// block's integer sum (Q4_0: -8 sum x, Q8_0: -128 sum x; int32).
struct ActScales {
  std::vector<float> d, s;
  std::vector<int32_t> start;
};

template <int T>
void act_scales(const uint8_t* xq, int64_t M, int64_t nb, ActScales& a) {
  constexpr int64_t abb = Layout<T>::abb;
  constexpr int aq = Layout<T>::aq;
  a.d.resize(M * nb);
  a.s.resize(M * nb);
  a.start.resize(M * nb);
  for (int64_t i = 0; i < M * nb; ++i) {
    const uint8_t* ab = xq + i * abb;
    a.d[i] = fp16_load(ab);
    a.s[i] = T == kQ4_1 ? fp16_load(ab + 2) : 0.f;
    int32_t sum = 0;
    if (T != kQ4_1) {
#ifdef __AVX2__
      // sum x = sum (x + 128) - 32 * 128, the unsigned sums by vpsadbw
      const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ab + aq)),
                                         _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i t = _mm256_sad_epu8(u, _mm256_setzero_si256());
      const __m128i t2 = _mm_add_epi64(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      sum = static_cast<int32_t>(_mm_cvtsi128_si64(t2) + _mm_extract_epi64(t2, 1)) - 32 * 128;
#else
      for (int j = 0; j < kQK; ++j) sum += static_cast<int8_t>(ab[aq + j]);
#endif
    }
    a.start[i] = T == kQ4_0 ? -8 * sum : T == kQ8_0 ? -128 * sum : 0;
  }
}

// One packed group against one row of x (nb blocks), into y[0..16): the
// scalar path, dot_scalar on each row as stored.
template <int T>
void group_scalar(const uint8_t* group, const uint8_t* a, int64_t nb, float* y, int rows) {
  constexpr int64_t wbb = Layout<T>::wbb;
  std::vector<uint8_t> row(nb * wbb);
  for (int i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) unpack_block<T>(group, i, b, row.data() + b * wbb);
    y[i] = dot_scalar<T>(row.data(), a, nb);
  }
}

#ifdef __AVX2__
// A packed group against C rows of x (AVX2; AVX-512 machines without VNNI):
// the 16 rows as two halves of 8 lanes. The vector integer multiplies
// bound it (Zen 3: two a cycle, vpmaddubsw and vpmaddwd alike), so the Q4
// blocks spend 9 multiplies on 256 products, not 16: the 8
// vpmaddubsw of a block add up in int16 (a lane pair is at most
// 2 * 15 * 128 = 3840, 8 of them 30720 < 32767: exact) and one vpmaddwd
// with ones widens the block's sums to int32. The 8 weight vectors of a
// block, unpacked once, stay in registers for the C rows of x; Q4_1's
// m_w * s_x chain runs as a second pass over the group's blocks (the same
// float operations in the same order: its own chain) so that the C float
// accumulators and the weights fit AVX2's 16 registers.
// Q8_0's w + 128 times x could saturate vpmaddubsw's int16 pairs: it takes
// |w| and x with w's sign instead (the same integers), one vpmaddwd per k.
template <int T, int C>
void group_tile_avx2(const uint8_t* group, const uint8_t* xq, int64_t arow, const ActScales& as, int64_t m0, int64_t nb,
                     float* y, int64_t ldy) {
  constexpr int64_t wbb = Layout<T>::wbb, qo = Layout<T>::qoff, abb = Layout<T>::abb;
  constexpr int aq = Layout<T>::aq;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const uint8_t* xr = xq + m0 * arow + aq;
  const float* xd = as.d.data() + m0 * nb;
  const int32_t* xs = as.start.data() + m0 * nb;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* o = group + b * kGroup * wbb;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 * h)));
      if constexpr (T == kQ8_0) {
        for (int c = 0; c < C; ++c) {
          const uint8_t* xb = xr + c * arow + b * abb;
          __m256i s = _mm256_setzero_si256();
          for (int k = 0; k < 8; ++k) {
            const __m256i wv =
                _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + qo + 64 * k + 32 * h)), flip);
            int32_t x4;
            std::memcpy(&x4, xb + 4 * k, 4);
            const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(_mm256_set1_epi32(x4), wv));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
          }
          acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[c * nb + b])), _mm256_cvtepi32_ps(s), acc[c]);
        }
      } else {
        __m256i wv[8];
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + qo + 64 * p + 32 * h));
          wv[p] = _mm256_and_si256(v, low);
          wv[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int c = 0; c < C; ++c) {
          const uint8_t* xb = xr + c * arow + b * abb;
          __m256i p[8];
          for (int k = 0; k < 8; ++k) {
            int32_t x4;
            std::memcpy(&x4, xb + 4 * k, 4);
            p[k] = _mm256_maddubs_epi16(wv[k], _mm256_set1_epi32(x4));
          }
          // A tree, not a chain of 7 dependent adds (exact either way).
          const __m256i s16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                               _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
          __m256i s = _mm256_madd_epi16(s16, ones);
          if (T == kQ4_0) s = _mm256_add_epi32(s, _mm256_set1_epi32(xs[c * nb + b]));
          acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[c * nb + b])), _mm256_cvtepi32_ps(s), acc[c]);
        }
      }
    }
    if constexpr (T == kQ4_1) {
      __m256 accm[C];
      for (int c = 0; c < C; ++c) accm[c] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* o = group + b * kGroup * wbb;
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + 16 * h)));
        for (int c = 0; c < C; ++c)
          accm[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(as.s[(m0 + c) * nb + b]), accm[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy + 8 * h, _mm256_add_ps(acc[c], accm[c]));
    } else {
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy + 8 * h, acc[c]);
    }
  }
}
#endif

#ifdef __AVX2__
// The Q4 groups' GEMM tile on AVX2 (2 or more rows of x): group_tile_avx2's
// integers and float operations, with x read as vpmaddubsw's memory operand
// from xb, where each 4 bytes of a row's quants were broadcast to 32 once
// (xb_broadcast) for every group of a group block. vpbroadcastd loads cost
// about as much as the products they feed (a micro-benchmark of the tile:
// 160 GOP/s a core with them, 190 from xb in L1, 150 from xb in L2), so xb
// holds a chunk of blocks [b0, b1) of C rows that stays in L1, and the
// float sums carry from chunk to chunk in y (exact: float stores). Q4_1's
// m_w * s_x chain runs on the last chunk, over all the blocks, as
// group_tile_avx2's does. The unroll pragmas keep the C accumulators in
// registers (GCC otherwise loops over C with them in memory: 15% slower).
constexpr int kXbRows = 6;              // rows of x a tile: 8 weight + 6 float accumulator registers
constexpr int64_t kXbBytes = 16 << 10;  // a chunk of broadcast x (with the group's blocks, in L1)

// Rows [m0, m0 + C) of x, blocks [b0, b1) -> xb [b - b0][c][k]: 8 vectors of 32 bytes, vector k = bytes 4k..4k+3 x 8.
inline void xb_broadcast(const uint8_t* xq, int64_t arow, int aq, int64_t abb, int64_t m0, int C, int64_t b0,
                         int64_t b1, uint8_t* xb) {
  for (int64_t b = b0; b < b1; ++b)
    for (int c = 0; c < C; ++c) {
      const uint8_t* q = xq + (m0 + c) * arow + b * abb + aq;
      uint8_t* o = xb + ((b - b0) * C + c) * 256;
      for (int k = 0; k < 8; ++k) {
        int32_t x4;
        std::memcpy(&x4, q + 4 * k, 4);
        _mm256_store_si256(reinterpret_cast<__m256i*>(o + 32 * k), _mm256_set1_epi32(x4));
      }
    }
}

template <int T, int C>
void group_tile_xb(const uint8_t* group, const uint8_t* xb, const ActScales& as, int64_t m0, int64_t nb, int64_t b0,
                   int64_t b1, float* y, int64_t ldy) {
  static_assert(T == kQ4_0 || T == kQ4_1);
  constexpr int64_t wbb = Layout<T>::wbb, qo = Layout<T>::qoff;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const float* xd = as.d.data() + m0 * nb;
  const int32_t* xs = as.start.data() + m0 * nb;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[c] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + c * ldy + 8 * h);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* o = group + b * kGroup * wbb;
      const uint8_t* xc = xb + (b - b0) * C * 256;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 * h)));
      __m256i wv[8];
#pragma GCC unroll 8
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + qo + 64 * p + 32 * h));
        wv[p] = _mm256_and_si256(v, low);
        wv[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        __m256i p[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k)
          p[k] = _mm256_maddubs_epi16(wv[k], _mm256_load_si256(reinterpret_cast<const __m256i*>(xc + c * 256 + 32 * k)));
        const __m256i s16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                                             _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])));
        __m256i s = _mm256_madd_epi16(s16, ones);
        if (T == kQ4_0) s = _mm256_add_epi32(s, _mm256_set1_epi32(xs[c * nb + b]));
        acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[c * nb + b])), _mm256_cvtepi32_ps(s), acc[c]);
      }
    }
    if (T == kQ4_1 && b1 == nb) {
      __m256 accm[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) accm[c] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + b * kGroup * wbb + 32 + 16 * h)));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) accm[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(as.s[(m0 + c) * nb + b]), accm[c]);
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[c] = _mm256_add_ps(acc[c], accm[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + c * ldy + 8 * h, acc[c]);
  }
}

// A thread's groups [n0, g1) against rows [0, M) of x (M >= 2) with group_tile_xb: the groups in blocks
// of about kGroupBlockBytes (in L2), each block against every tile of rows, chunk by chunk of blocks.
constexpr int64_t kGroupBlockBytes = 192 << 10;
template <int T>
void groups_xb(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t nb, int64_t n0,
               int64_t g1, const ActScales& as) {
  constexpr int64_t wbb = Layout<T>::wbb, abb = Layout<T>::abb;
  const int64_t wrow = nb * wbb, arow = nb * abb;
  const int64_t chunks = (nb * kXbRows * 256 + kXbBytes - 1) / kXbBytes, kb = (nb + chunks - 1) / chunks;
  const int64_t gb = std::max<int64_t>(1, kGroupBlockBytes / (kGroup * wrow)) * kGroup;
  struct alignas(32) Vec { uint8_t b[32]; };
  thread_local std::vector<Vec> xbuf;
  xbuf.resize(kb * kXbRows * 8);
  uint8_t* xb = reinterpret_cast<uint8_t*>(xbuf.data());
  for (int64_t nbk = n0; nbk < g1; nbk += gb) {
    const int64_t ne = std::min(g1, nbk + gb);
    for (int64_t m = 0; m < M; m += kXbRows) {
      const int C = static_cast<int>(std::min<int64_t>(kXbRows, M - m));
      for (int64_t b0 = 0; b0 < nb; b0 += kb) {
        const int64_t b1 = std::min(nb, b0 + kb);
        xb_broadcast(xq, arow, Layout<T>::aq, abb, m, C, b0, b1, xb);
        for (int64_t n = nbk; n < ne; n += kGroup) {
          const uint8_t* g = w + n * wrow;
          float* yt = y + m * ldy + n;
          switch (C) {
            case 6: group_tile_xb<T, 6>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
            case 5: group_tile_xb<T, 5>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
            case 4: group_tile_xb<T, 4>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
            case 3: group_tile_xb<T, 3>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
            case 2: group_tile_xb<T, 2>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
            default: group_tile_xb<T, 1>(g, xb, as, m, nb, b0, b1, yt, ldy); break;
          }
        }
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHavePackedVnni = true;
// A packed group against C rows of x: one vector of 16 rows' block sums a row of x.
template <int T, int C>
void group_tile_vnni(const uint8_t* group, const uint8_t* xq, int64_t arow, const ActScales& as, int64_t m0,
                     int64_t nb, float* y, int64_t ldy) {
  constexpr int64_t wbb = Layout<T>::wbb, qo = Layout<T>::qoff;
  constexpr int aq = Layout<T>::aq;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[C], accm[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps(), accm[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = group + b * kGroup * wbb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
    __m512 m = _mm512_setzero_ps();
    if (T == kQ4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32)));
    __m512i wv[8];
    if (T == kQ8_0) {
      for (int k = 0; k < 8; ++k) wv[k] = _mm512_loadu_si512(o + qo + 64 * k);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(o + qo + 64 * p);
        wv[p] = _mm512_and_si512(v, low);
        wv[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    for (int c = 0; c < C; ++c) {
      const int64_t i = (m0 + c) * nb + b;
      const uint8_t* xb = xq + (m0 + c) * arow + b * Layout<T>::abb + aq;
      __m512i s = _mm512_set1_epi32(as.start[i]);
      for (int k = 0; k < 8; ++k) {
        int32_t x4;
        std::memcpy(&x4, xb + 4 * k, 4);
        s = _mm512_dpbusd_epi32(s, wv[k], _mm512_set1_epi32(x4));
      }
      acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(as.d[i])), _mm512_cvtepi32_ps(s), acc[c]);
      if (T == kQ4_1) accm[c] = _mm512_fmadd_ps(m, _mm512_set1_ps(as.s[i]), accm[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + c * ldy, T == kQ4_1 ? _mm512_add_ps(acc[c], accm[c]) : acc[c]);
}
#else
constexpr bool kHavePackedVnni = false;
#endif

// From this many rows of x the multi-row tiles run (fewer: one row of x at a
// time); set_gguf_gemm_min_rows moves it (tests, benchmarks). Either gives the same bits.
std::atomic<int64_t> g_gemm_min_rows{2};
// The AVX2 Q8_0 tile's rows of x, and the bytes of quantized x a cache-blocking run holds.
constexpr int64_t kTileRows = 4, kXRunBytes = 160 << 10;

// Weight rows [n0, n1) of a packed matrix (n0 a multiple of 16) against rows
// [0, M) of x: its groups, then any of the tail rows.
template <int T>
void rows_range(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t N, int64_t nb,
                int64_t n0, int64_t n1, bool scalar) {
  constexpr int64_t wbb = Layout<T>::wbb;
  const int64_t wrow = nb * wbb, arow = nb * Layout<T>::abb, N16 = N / kGroup * kGroup;
  const int64_t g1 = std::min(n1, N16);
  const bool multi = M >= g_gemm_min_rows.load();
#ifdef __AVX2__
  if (!scalar) {
    const bool vnni = kHaveVnni && kHavePackedVnni && get_isa() == "avx512";
    thread_local ActScales as;
    if (n0 < g1) act_scales<T>(xq, M, nb, as);
    // Q4 on AVX2: broadcast x in L1 (groups_xb). Otherwise cache blocking: the rows of x
    // in runs of about kXRunBytes (in L2 with the group in L1), each run against all of
    // this thread's groups.
    const bool xb = multi && !vnni && T != kQ8_0;
    if constexpr (T != kQ8_0)
      if (xb && n0 < g1) groups_xb<T>(xq, w, y, ldy, M, nb, n0, g1, as);
    const int64_t run = multi ? std::max<int64_t>(8, kXRunBytes / arow / 8 * 8) : M;
    for (int64_t mr = 0; mr < M && !xb; mr += run) {
      const int64_t me = std::min(M, mr + run);
      for (int64_t n = n0; n < g1; n += kGroup) {
        const uint8_t* g = w + n * wrow;
        int64_t m = mr;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (vnni) {
          // 32 registers: 8 rows of x a tile (8 weight vectors, 16 accumulators).
          if (multi)
            for (; m + 8 <= me; m += 8) group_tile_vnni<T, 8>(g, xq, arow, as, m, nb, y + m * ldy + n, ldy);
          if (multi)
            for (; m + 4 <= me; m += 4) group_tile_vnni<T, 4>(g, xq, arow, as, m, nb, y + m * ldy + n, ldy);
          for (; m < me; ++m) group_tile_vnni<T, 1>(g, xq, arow, as, m, nb, y + m * ldy + n, ldy);
          continue;
        }
#endif
        if (multi)
          for (; m + kTileRows <= me; m += kTileRows)
            group_tile_avx2<T, kTileRows>(g, xq, arow, as, m, nb, y + m * ldy + n, ldy);
        for (; m < me; ++m) group_tile_avx2<T, 1>(g, xq, arow, as, m, nb, y + m * ldy + n, ldy);
      }
    }
    // The tail rows, as stored.
    int64_t n = std::max(n0, N16);
    const auto tail = [&](auto v) {
      constexpr bool V = decltype(v)::value;
      for (; n + 4 <= n1; n += 4)
        multi ? tail_tiles<T, V, 4, 4>(w + n * wrow, wrow, xq, arow, nb, y + n, ldy, M)
              : tail_tiles<T, V, 4, 1>(w + n * wrow, wrow, xq, arow, nb, y + n, ldy, M);
      for (; n < n1; ++n)
        multi ? tail_tiles<T, V, 1, 4>(w + n * wrow, wrow, xq, arow, nb, y + n, ldy, M)
              : tail_tiles<T, V, 1, 1>(w + n * wrow, wrow, xq, arow, nb, y + n, ldy, M);
    };
    if (vnni)
      tail(std::integral_constant<bool, kHaveVnni>());
    else
      tail(std::integral_constant<bool, false>());
    return;
  }
#endif
  for (int64_t n = n0; n < g1; n += kGroup) {
    float out[kGroup];
    for (int64_t m = 0; m < M; ++m) {
      group_scalar<T>(w + n * wrow, xq + m * arow, nb, out, kGroup);
      std::memcpy(y + m * ldy + n, out, sizeof(out));
    }
  }
  for (int64_t n = std::max(n0, N16); n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot_scalar<T>(w + n * wrow, xq + m * arow, nb);
}

template <int T>
void gemm(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, bool scalar) {
  // Threads take runs of whole groups (the tail rows go with the last).
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t t0, int64_t t1) {
    rows_range<T>(xq, w, y, N, M, N, K / kQK, t0 * kGroup, std::min(N, t1 * kGroup), scalar);
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

namespace {
int64_t check_blocks(const torch::Tensor& w, int64_t ggml_type, const char* op) {
  const int64_t bb = weight_block_bytes(ggml_type);
  TORCH_CHECK(bb > 0, op, ": ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), not ", ggml_type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) % bb == 0,
              op, ": blocks contiguous uint8 [rows, whole blocks of ", bb, " bytes]");
  return bb;
}

template <int T>
void pack_rows(const uint8_t* w, uint8_t* out, int64_t N, int64_t nb, bool unpack) {
  const int64_t wrow = nb * Layout<T>::wbb, N16 = N / kGroup * kGroup;
  at::parallel_for(0, N16 / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (!unpack) {
        pack_group<T>(w + g * kGroup * wrow, wrow, nb, out + g * kGroup * wrow);
        continue;
      }
      for (int i = 0; i < kGroup; ++i)
        for (int64_t b = 0; b < nb; ++b)
          unpack_block<T>(w + g * kGroup * wrow, i, b, out + (g * kGroup + i) * wrow + b * Layout<T>::wbb);
    }
  });
  std::memcpy(out + N16 * wrow, w + N16 * wrow, (N - N16) * wrow);  // the tail rows, as stored
}

template <int T>
void row_of_packed(const uint8_t* w, int64_t N, int64_t nb, int64_t r, uint8_t* out) {
  const int64_t wrow = nb * Layout<T>::wbb, N16 = N / kGroup * kGroup;
  if (r >= N16) {
    std::memcpy(out, w + r * wrow, wrow);
    return;
  }
  for (int64_t b = 0; b < nb; ++b) unpack_block<T>(w + r / kGroup * kGroup * wrow, r % kGroup, b, out + b * Layout<T>::wbb);
}
}  // namespace

// GGUF blocks [N, row bytes] as stored -> the same bytes packed in groups of
// 16 rows for gguf_linear (unpack: the inverse).
torch::Tensor gguf_pack(torch::Tensor w_blocks, int64_t ggml_type, bool unpack) {
  const int64_t bb = check_blocks(w_blocks, ggml_type, "gguf_pack");
  auto out = torch::empty_like(w_blocks);
  const int64_t N = w_blocks.size(0), nb = w_blocks.size(1) / bb;
  const uint8_t* wp = w_blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  if (ggml_type == kQ4_0)
    pack_rows<kQ4_0>(wp, op, N, nb, unpack);
  else if (ggml_type == kQ4_1)
    pack_rows<kQ4_1>(wp, op, N, nb, unpack);
  else
    pack_rows<kQ8_0>(wp, op, N, nb, unpack);
  return out;
}

// Rows `ids` of a packed matrix, as stored in the file (an embedding lookup's rows).
torch::Tensor gguf_packed_rows(torch::Tensor w_packed, torch::Tensor ids, int64_t ggml_type) {
  const int64_t bb = check_blocks(w_packed, ggml_type, "gguf_packed_rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "gguf_packed_rows: int64 ids [n]");
  const torch::Tensor ic = ids.contiguous();
  const int64_t n = ic.numel(), N = w_packed.size(0), row = w_packed.size(1), nb = row / bb;
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "gguf_packed_rows: id out of range");
  auto out = torch::empty({n, row}, w_packed.options());
  const uint8_t* wp = w_packed.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (ggml_type == kQ4_0)
      row_of_packed<kQ4_0>(wp, N, nb, ip[i], op + i * row);
    else if (ggml_type == kQ4_1)
      row_of_packed<kQ4_1>(wp, N, nb, ip[i], op + i * row);
    else
      row_of_packed<kQ8_0>(wp, N, nb, ip[i], op + i * row);
  }
  return out;
}

// x: [M, K] float32; w_packed: gguf_pack's [N, K / 32 * block bytes] uint8
// of ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0) -> [M, N] float32.
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
void linear_rows_t(const uint8_t* xq, const uint8_t* w, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                   int64_t n0, int64_t n1) {
  rows_range<T>(xq, w, y, ldy, M, N, K / kQK, n0, n1, false);
}
}  // namespace

void gguf_linear_rows(const uint8_t* xq, const uint8_t* w, int64_t ggml_type, float* y, int64_t ldy, int64_t M,
                      int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (ggml_type == kQ4_0)
    linear_rows_t<kQ4_0>(xq, w, y, ldy, M, N, K, n0, n1);
  else if (ggml_type == kQ4_1)
    linear_rows_t<kQ4_1>(xq, w, y, ldy, M, N, K, n0, n1);
  else
    linear_rows_t<kQ8_0>(xq, w, y, ldy, M, N, K, n0, n1);
}

int64_t gguf_weight_block_bytes(int64_t ggml_type) { return weight_block_bytes(ggml_type); }

// Rows `ids` of a packed Q8_0 or Q4_0 matrix as float32: gguf.py's
// dequantize of the rows an embedding lookup reads (d * q, d * (q - 8): one
// rounding, so its bits), without its dozen torch ops a decode step.
torch::Tensor gguf_embedding(torch::Tensor ids, torch::Tensor w_blocks, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kQ8_0 || ggml_type == kQ4_0, "gguf_embedding: ggml_type 8 (Q8_0) or 2 (Q4_0), not ",
              ggml_type);
  const int64_t bb = weight_block_bytes(ggml_type);
  const torch::Tensor rows = gguf_packed_rows(w_blocks, ids, ggml_type);
  const int64_t n = rows.size(0), nb = rows.size(1) / bb;
  auto out = torch::empty({n, nb * kQK}, ids.options().dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = rows.data_ptr<uint8_t>() + i * rows.size(1);
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
