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
// 4j..4j+3 (vpmaddubsw + vpmaddwd with ones, or vpdpbusd under AVX-512
// VNNI, which sums the same 4 bytes and so gives the same integers), then
// acc[j] = fma(d_w * d_x, float(lane j), acc[j]) over the blocks, one
// horizontal sum at the end (Q4_1 adds the scalar sum of m * s over the
// blocks). The scalar path does exactly the same float operations in the
// same order, so it gives the same bits; force_scalar picks it (tests).
// As in llama.cpp, a Q8_0 weight of -128 (gguf never writes one) can
// saturate vpmaddubsw's int16 pair sums on the AVX2 path.
//
// Decode rows only (a GEMV): threads split the weight rows; each takes four
// weight rows at a time (four independent accumulation chains: one chain is
// bound by the FMA's latency) against every row of x in turn, so the weights
// are read from memory once per call and stay in L1 for the other rows of x.
// Q4_0's (q - 8) y is summed as q y - 8 y, the second term once per
// activation block (the same integers as llama.cpp's sign trick, fewer
// instructions). Software prefetch runs two tiles ahead: the hardware
// prefetcher does not follow four short row streams.
// Measured (1 thread, Zen 4, SmolLM2's MLP shapes, M = 1, weights from
// memory): 15-17 GB/s of Q4 blocks, 30 GB/s of Q8_0 blocks, 2.4-3.2x the
// float32 small_m_linear's time per call (benchmarks/gguf_kernels.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx2_math.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQK = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

inline int64_t weight_block_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0;
}

// fp16 <-> float32 (F16C where the CPU has it; both ways round to nearest even, as ggml's).
inline float fp16_load(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
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
    if (T == kQ4_1) summs += fp16_load(w + 2) * fp16_load(a + 2);
  }
  return hsum8(acc) + summs;
}

#ifdef __AVX2__
// u8 x s8, 4 adjacent products summed into each int32 lane.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// s8 x s8: the sign of x moved onto y, so the unsigned operand is |x|.
inline __m256i dot_s8s8(__m256i x, __m256i y) {
  return dot_u8s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}
inline __m256i nibbles(const uint8_t* q) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// R weight rows (row stride wrow bytes) against one activation row: R
// independent accumulation chains, one load of each activation block; each
// row's float operations are those of one row alone, in the same order.
template <int T, int R>
void dot_avx2(const uint8_t* w, int64_t wrow, const uint8_t* a, int64_t nb, float* out, int64_t out_stride) {
  constexpr int64_t wbb = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : 34, abb = T == kQ4_1 ? 36 : 34;
  constexpr int wq = T == kQ4_1 ? 4 : 2, aq = T == kQ4_1 ? 4 : 2;
  constexpr int64_t kAhead = 2;  // tiles of R rows
  __m256 acc[R];
  float summs[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), summs[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b, a += abb) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + aq));
    const float da = fp16_load(a);
    // Q4_0: sum (q - 8) y = sum q y - 8 sum y, lane by lane (exact integers), the
    // second term once per activation block for all R rows.
    __m256i y8 = _mm256_setzero_si256();
    if (T == kQ4_0) y8 = dot_u8s8(_mm256_set1_epi8(8), y);
    if (R > 1) {
      // The R rows are 4 short streams that the hardware prefetcher does not
      // follow (measured: from memory, 3-5x slower than from cache); together
      // they are one contiguous run of R * wrow bytes, so fetch the run kAhead
      // tiles on as this one goes.
      const char* p = reinterpret_cast<const char*>(w + kAhead * R * wrow + b * R * wbb);
      for (int64_t o = 0; o < R * wbb; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + r * wrow + b * wbb;
      __m256i l;
      if (T == kQ8_0)
        l = dot_s8s8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + wq)), y);
      else if (T == kQ4_0)
        l = _mm256_sub_epi32(dot_u8s8(nibbles(wb + wq), y), y8);
      else
        l = dot_u8s8(nibbles(wb + wq), y);
      const __m256 d = _mm256_set1_ps(fp16_load(wb) * da);
      acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), acc[r]);
      if (T == kQ4_1) summs[r] += fp16_load(wb + 2) * fp16_load(a + 2);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = hsum256(acc[r]) + summs[r];
}
#endif

template <int T>
void gemv(const uint8_t* xq, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, bool scalar) {
  const int64_t nb = K / kQK, wrow = nb * weight_block_bytes(T), arow = nb * (T == kQ4_1 ? 36 : 34);
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
#ifdef __AVX2__
    if (!scalar) {  // four weight rows at a time, kept in L1 across the rows of x
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4)
        for (int64_t m = 0; m < M; ++m) dot_avx2<T, 4>(w + n * wrow, wrow, xq + m * arow, nb, y + m * N + n, 1);
      for (; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) dot_avx2<T, 1>(w + n * wrow, wrow, xq + m * arow, nb, y + m * N + n, 1);
      return;
    }
#endif
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
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, op + m * row, K, q8_1, scalar);
  return out;
}

}  // namespace

// x: [M, K] float32 -> [M, K / 32 * 34] uint8 block_q8_0 rows (q8_1: [M, K / 32 * 36] block_q8_1).
torch::Tensor quantize_q8_activations(torch::Tensor x, bool q8_1, bool force_scalar) {
  return quantize_rows(x, q8_1, force_scalar);
}

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
    gemv<kQ4_0>(xp, wp, yp, M, N, K, force_scalar);
  else if (ggml_type == kQ4_1)
    gemv<kQ4_1>(xp, wp, yp, M, N, K, force_scalar);
  else
    gemv<kQ8_0>(xp, wp, yp, M, N, K, force_scalar);
  return y;
}
