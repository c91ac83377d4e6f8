// y = x W^T (+ b) for the few rows of a decode step, on the CPU.
//
// At a handful of rows a linear layer is a read of its weights, and the
// BLAS torch calls reaches half the machine's read bandwidth there (its
// small-M path is built for larger M). Here each thread walks its own
// range of weight rows once, four at a time, against up to three rows of x
// held in registers (12 accumulators), so every weight is read from memory
// once per 48 rows of x. From 8 rows up a batched decode step is bound by
// the FMAs, not the read, and float32 weights take outer-product tiles
// (avx2_k::gemm_rows_outer) that reach 80% of the float32 peak where MKL's
// sgemm reaches 60%. float32 in, float32 accumulation and out; the
// weights may be float32 or bfloat16 (the opt-in half-size store: a
// bfloat16 is the top half of a float32, so widening it is a shift).
//
// Two builds of the same loops: AVX2 (8-float vectors) and, where the
// compiler targets AVX-512F (-march=native on such a CPU), 16-float
// vectors. Both take x in the same order (bfloat16: see prepare_x), and the
// products are float32-exact in both; only the order of the sums differs,
// so the two agree to the last bits. The widest compiled in is used unless
// set_isa (or SHOAL_CPU_ISA=avx2|avx512, read at load) says otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "avx2_math.h"

#ifdef __AVX2__
namespace avx2_k {

// 16 weights from k as two float vectors (a, b); x is laid out to match (see prepare_x).
inline void load16(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}
// A 32-bit lane holds bfloat16 k (low half) and k + 1 (high half): the low one
// widens by a shift, the high one by masking off the low.
inline void load16(const at::BFloat16* w, __m256& a, __m256& b) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// MR rows of x against NR rows of w: y[i * ldy + j].
template <typename W, int MR, int NR>
inline void tile(const float* x, const W* w, float* y, int64_t K, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 wa[NR], wb[NR];
    for (int j = 0; j < NR; ++j) load16(w + j * K + k, wa[j], wb[j]);
    for (int i = 0; i < MR; ++i) {
      const __m256 xa = _mm256_loadu_ps(x + i * K + k), xb = _mm256_loadu_ps(x + i * K + k + 8);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xb, wb[j], _mm256_fmadd_ps(xa, wa[j], acc[i][j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum256(acc[i][j]);
}

template <typename W, int NR>
inline void rows_of_x(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<W, 3, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<W, 2, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<W, 1, NR>(x + m * K, w, y + m * N, K, N);
}

// One row of x (a single stream's step), weight rows [n0, n1): one after
// another, four accumulators across k, so a thread's reads are one
// sequential stream; prefetching ahead of it helps the bfloat16 loop, whose
// widening leaves the hardware prefetcher behind (measured: 10.6 -> 16.7
// GB/s), and not the float32 one.
template <typename W>
void gemv_rows(const float* x, const W* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = sizeof(W) == 2 ? 1024 : 0;  // bytes
  for (int64_t n = n0; n < n1; ++n) {
    const W* r = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, wa, wb, wc, wd;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      if (kAhead) _mm_prefetch(reinterpret_cast<const char*>(r + k) + kAhead, _MM_HINT_T0);
      load16(r + k, wa, wb);
      load16(r + k + 16, wc, wd);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), wa, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), wb, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), wc, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), wd, a3);
    }
    if (k < K) {  // K is a multiple of 16
      load16(r + k, wa, wb);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), wa, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), wb, a1);
    }
    y[n] = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
}

// Eight rows of x or more against float32 weights: the dot-product tiles
// above need more than AVX2's 16 registers (12 sums, 8 weight halves, x) and
// spill, at 40% of the FMA peak. Here x is transposed once per block of
// rows (panels of 16: xt[k * 16 + i]) and the tile is an outer product: 8 * MV rows of x
// as vectors against NR weights broadcast one at a time, 2 * 6 sums + 2 x
// vectors + 1 broadcast = 15 registers. Each y[i][n] is summed in k order,
// one FMA at a time, whatever the tiling: the same bits at any row count
// (8 and up) and thread count.

// One weight row's sums (8 * MV rows of x) to y's first `rows` rows, stride ldy.
template <int MV>
__attribute__((noinline)) void store_col(__m256 a0, __m256 a1, float* y, int64_t ldy, int64_t rows) {
  alignas(32) float col[16];
  _mm256_store_ps(col, a0);
  if (MV == 2) _mm256_store_ps(col + 8, a1);
  for (int64_t r = 0; r < rows; ++r) y[r * ldy] = col[r];
}

// Every loop over the sums is unrolled whole: where one was left rolled,
// GCC kept the array in memory and stored all 12 sums on every k
// (measured: 33 against 93 GFLOP/s on one core).
template <int MV, int NR>
void outer_tile(const float* xt, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t rows) {
  __m256 acc[NR][MV];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xv[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) xv[v] = _mm256_loadu_ps(xt + k * ldx + 8 * v);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m256 wb = _mm256_broadcast_ss(w + j * K + k);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) acc[j][v] = _mm256_fmadd_ps(xv[v], wb, acc[j][v]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) store_col<MV>(acc[j][0], acc[j][MV - 1], y + j, ldy, rows);
}

constexpr int64_t kOuterMinRows = 8;

// x's rows [m0, m0 + mb) transposed into panels of 16 rows, each K x 16
// floats read front to back by its tiles (a panel's rows past mb are zero).
inline void pack_panels(const float* x, int64_t K, int64_t m0, int64_t mb, std::vector<float>& xt) {
  const int64_t panels = (mb + 15) / 16;
  xt.assign(static_cast<size_t>(panels * K * 16), 0.0f);
  for (int64_t i = 0; i < mb; ++i) {
    float* dst = xt.data() + (i / 16) * K * 16 + i % 16;
    const float* src = x + (m0 + i) * K;
    for (int64_t k = 0; k < K; ++k) dst[k * 16] = src[k];
  }
}

// The panels of mb rows against NR weight rows: whole panels as 16-row
// tiles, a last one of 8 rows or fewer as an 8-row tile.
template <int NR>
inline void outer_tiles(const float* xt, int64_t mb, const float* w, int64_t K, float* y, int64_t ldy) {
  for (int64_t i = 0; i < mb; i += 16) {
    const int64_t rows = std::min<int64_t>(16, mb - i);
    const float* panel = xt + (i / 16) * K * 16;
    if (rows > 8)
      outer_tile<2, NR>(panel, 16, w, K, y + i * ldy, ldy, rows);
    else
      outer_tile<1, NR>(panel, 16, w, K, y + i * ldy, ldy, rows);
  }
}

inline void gemm_rows_outer(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                            int64_t n1) {
  constexpr int64_t kRowsInCache = 64;  // 4 panels (K = 576: 147 KB) stay in L2 while the weights pass
  thread_local std::vector<float> xt;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsInCache) {
    const int64_t mb = std::min(kRowsInCache, M - m0);
    pack_panels(x, K, m0, mb, xt);
    float* ym = y + m0 * N;
    int64_t n = n0;
    for (; n + 6 <= n1; n += 6) outer_tiles<6>(xt.data(), mb, w + n * K, K, ym + n, N);
    for (; n < n1; ++n) outer_tiles<1>(xt.data(), mb, w + n * K, K, ym + n, N);
  }
}

// M rows of x, weight rows [n0, n1): four weight rows at a time.
template <typename W>
void gemm_rows(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 1) return gemv_rows(x, w, y, K, n0, n1);
  if constexpr (std::is_same_v<W, float>)
    if (M >= kOuterMinRows) return gemm_rows_outer(x, w, y, M, N, K, n0, n1);
  constexpr int64_t kRowsInCache = 48;  // rows of x kept in L2 while a thread walks its weights
  for (int64_t m0 = 0; m0 < M; m0 += kRowsInCache) {
    const int64_t mb = std::min(kRowsInCache, M - m0);
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_of_x<W, 4>(xm, w + n * K, ym + n, mb, N, K);
    for (; n < n1; ++n) rows_of_x<W, 1>(xm, w + n * K, ym + n, mb, N, K);
  }
}

}  // namespace avx2_k
#endif

#ifdef __AVX512F__
namespace avx512_k {

inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
// 16 bfloat16 in the lane order of the AVX2 loads, (k, k+2, ..., k+14) then
// (k+1, ..., k+15), so that x is laid out the same for both: the 32 bytes in
// both halves, the low half widened by a shift, the high one by a mask.
inline __m512 load16(const at::BFloat16* w) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(
      _mm512_mask_and_epi32(_mm512_slli_epi32(v, 16), 0xFF00, v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <typename W, int MR, int NR>
inline void tile(const float* x, const W* w, float* y, int64_t K, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NR];
    // prefetching ahead of each weight row: the 4 streams at a few rows of x are a read of the weights
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k) + 1024, _MM_HINT_T0);
    for (int j = 0; j < NR; ++j) wv[j] = load16(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <typename W, int NR>
inline void rows_of_x(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<W, 3, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<W, 2, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<W, 1, NR>(x + m * K, w, y + m * N, K, N);
}

// As avx2_k::gemv_rows, 64 weights per step: bfloat16 prefetches both lines it reads.
template <typename W>
void gemv_rows(const float* x, const W* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  constexpr int64_t kAhead = sizeof(W) == 2 ? 1024 : 0;  // bytes
  for (int64_t n = n0; n < n1; ++n) {
    const W* r = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      if (kAhead) {
        _mm_prefetch(reinterpret_cast<const char*>(r + k) + kAhead, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r + k) + kAhead + 64, _MM_HINT_T0);
      }
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(r + k), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(r + k + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), load16(r + k + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), load16(r + k + 48), a3);
    }
    for (; k < K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(r + k), a0);  // K % 16 == 0
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

template <typename W>
void gemm_rows(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 1) return gemv_rows(x, w, y, K, n0, n1);
  constexpr int64_t kRowsInCache = 48;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsInCache) {
    const int64_t mb = std::min(kRowsInCache, M - m0);
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_of_x<W, 4>(xm, w + n * K, ym + n, mb, N, K);
    for (; n < n1; ++n) rows_of_x<W, 1>(xm, w + n * K, ym + n, mb, N, K);
  }
}

}  // namespace avx512_k
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The opt-in bfloat16 dot product (small_m_linear_bf16dot): x rounded to
// bfloat16 too, and vdpbf16ps multiplies 32 pairs at a time with float32
// sums. Not float32-exact (x loses its low 16 bits), so never the default.
namespace bf16dot_k {

inline __m512bh ld32(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh ld16(const at::BFloat16* p) { return (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, p); }

template <int MR, int NR>
inline void tile(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t K, int64_t ldy) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = ld32(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = ld32(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {  // 16 left (K % 16 == 0): the other half of the lanes loads zeros
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = ld16(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = ld16(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NR>
inline void rows_of_x(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile<3, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 2) tile<2, NR>(x + m * K, w, y + m * N, K, N);
  if (M - m == 1) tile<1, NR>(x + m * K, w, y + m * N, K, N);
}

void gemm_rows(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  constexpr int64_t kRowsInCache = 48;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsInCache) {
    const int64_t mb = std::min(kRowsInCache, M - m0);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_of_x<4>(x + m0 * K, w + n * K, y + m0 * N + n, mb, N, K);
    for (; n < n1; ++n) rows_of_x<1>(x + m0 * K, w + n * K, y + m0 * N + n, mb, N, K);
  }
}

}  // namespace bf16dot_k
#endif

namespace {

enum Isa : int { kAvx2 = 0, kAvx512 = 1 };

#ifdef __AVX512F__
constexpr Isa kWidest = kAvx512;
#else
constexpr Isa kWidest = kAvx2;
#endif

Isa parse_isa(const std::string& name) {
  if (name == "auto" || name.empty()) return kWidest;
  if (name == "avx2") return kAvx2;
  if (name == "avx512") {
    TORCH_CHECK(kWidest == kAvx512, "set_isa: this build has no AVX-512 path (the CPU or compiler lacks AVX-512F)");
    return kAvx512;
  }
  TORCH_CHECK(false, "set_isa: expected 'auto', 'avx2' or 'avx512', got '", name, "'");
}

Isa isa_from_env() {
  const char* e = std::getenv("SHOAL_CPU_ISA");
  if (!e) return kWidest;
  const std::string name(e);
  if (name == "avx2") return kAvx2;
  return kWidest;  // "avx512" or "auto" (or anything else): the widest compiled in
}

std::atomic<int> g_isa{isa_from_env()};

#ifdef __AVX2__
template <typename W>
void gemm_rows(Isa isa, const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
#ifdef __AVX512F__
  if (isa == kAvx512) return avx512_k::gemm_rows(x, w, y, M, N, K, n0, n1);
#endif
  avx2_k::gemm_rows(x, w, y, M, N, K, n0, n1);
}

template <typename W>
void gemm(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const Isa isa = static_cast<Isa>(g_isa.load());
  // Chunks of whole 4-row tiles (64 rows at least, so one row's chunks are not tiny).
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    gemm_rows(isa, x, w, y, M, N, K, begin * 4, std::min(N, end * 4));
  });
}
#endif

const char* isa_name(Isa isa) { return isa == kAvx512 ? "avx512" : "avx2"; }

}  // namespace

std::string set_isa(const std::string& name) {
  const Isa old = static_cast<Isa>(g_isa.exchange(parse_isa(name)));
  return isa_name(old);
}

std::string get_isa() { return isa_name(static_cast<Isa>(g_isa.load())); }

#ifdef __AVX2__
void linear_rows(const float* x, const torch::Tensor& w, const float* bias, float* y, int64_t M, int64_t n0,
                 int64_t n1) {
  const int64_t N = w.size(0), K = w.size(1);
  const Isa isa = static_cast<Isa>(g_isa.load());
  if (w.scalar_type() == torch::kFloat32)
    gemm_rows(isa, x, w.data_ptr<float>(), y, M, N, K, n0, n1);
  else
    gemm_rows(isa, x, w.data_ptr<at::BFloat16>(), y, M, N, K, n0, n1);
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
}

void interleave_for_bf16(const float* x, float* out, int64_t K) {
  for (int64_t b = 0; b < K; b += 16)
    for (int64_t j = 0; j < 8; ++j) {
      out[b + j] = x[b + 2 * j];
      out[b + 8 + j] = x[b + 2 * j + 1];
    }
}
#endif

// x: [M, K] float32; w: [N, K] float32 or bfloat16, K a multiple of 16 -> [M, N] float32.
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#ifndef __AVX2__
  TORCH_CHECK(false, "small_m_linear: built without AVX2");
#else
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_m_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "small_m_linear: float32 activations only");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "small_m_linear: float32 or bfloat16 weights");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % 16 == 0, "small_m_linear: contiguous weights, K a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // bfloat16 loads give lanes (k, k+2, ..., k+14) then (k+1, ..., k+15) per 16;
  // x is permuted once to the same order so that each product pairs up.
  torch::Tensor xs = w.scalar_type() == torch::kFloat32 ? x.contiguous()
                                                         : x.reshape({M, K / 16, 8, 2}).transpose(2, 3).contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (w.scalar_type() == torch::kFloat32)
    gemm(xs.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
  else
    gemm(xs.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, N, K);
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
#endif
}

// The experts of a MoE layer: rows [offsets[e], offsets[e + 1]) of x times
// w[e]^T, for every expert at once. x: [P, K] float32, its rows sorted by
// expert; w: [E, N, K] float32 or bfloat16, K a multiple of 16; offsets:
// [E + 1] int64 -> [P, N] float32. One parallel loop over every (expert,
// 64 weight rows) with rows, so the threads meet once, not once per expert.
torch::Tensor grouped_small_m_linear(torch::Tensor x, torch::Tensor w, torch::Tensor offsets) {
#ifndef __AVX2__
  TORCH_CHECK(false, "grouped_small_m_linear: built without AVX2");
#else
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), "grouped_small_m_linear: x [P, K], w [E, N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "grouped_small_m_linear: float32 activations only");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16,
              "grouped_small_m_linear: float32 or bfloat16 weights");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % 16 == 0, "grouped_small_m_linear: contiguous weights, K % 16 == 0");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.numel() == w.size(0) + 1 && offsets.is_contiguous() &&
                  offsets.device().is_cpu(),
              "grouped_small_m_linear: offsets [E + 1] int64 on the CPU");
  const int64_t P = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == P, "grouped_small_m_linear: offsets run from 0 to x's rows");
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  torch::Tensor xs = bf16 ? x.reshape({P, K / 16, 8, 2}).transpose(2, 3).contiguous() : x.contiguous();
  auto y = torch::empty({P, N}, x.options());
  constexpr int64_t kRows = 64;
  const int64_t chunks = (N + kRows - 1) / kRows;
  std::vector<int64_t> items;  // e * chunks + chunk, for the experts that have rows
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "grouped_small_m_linear: offsets must not decrease");
    if (off[e + 1] > off[e])
      for (int64_t c = 0; c < chunks; ++c) items.push_back(e * chunks + c);
  }
  const float* xp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa isa = static_cast<Isa>(g_isa.load());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = items[i] / chunks, n0 = items[i] % chunks * kRows, n1 = std::min(N, n0 + kRows);
      const int64_t m0 = off[e], M = off[e + 1] - m0;
      if (bf16)
        gemm_rows(isa, xp + m0 * K, w.data_ptr<at::BFloat16>() + e * N * K, yp + m0 * N, M, N, K, n0, n1);
      else
        gemm_rows(isa, xp + m0 * K, w.data_ptr<float>() + e * N * K, yp + m0 * N, M, N, K, n0, n1);
    }
  });
  return y;
#endif
}

// x: [M, K] float32, rounded to bfloat16 here; w: [N, K] bfloat16, K a
// multiple of 16 -> [M, N] float32 (float32 sums of bfloat16 products). An
// explicit opt-in for bfloat16 weights: small_m_linear keeps x in float32.
torch::Tensor small_m_linear_bf16dot(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
  TORCH_CHECK(false, "small_m_linear_bf16dot: built without AVX512_BF16");
#else
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_m_linear_bf16dot: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "small_m_linear_bf16dot: float32 activations only");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "small_m_linear_bf16dot: bfloat16 weights only");
  TORCH_CHECK(w.is_contiguous() && x.size(1) % 16 == 0,
              "small_m_linear_bf16dot: contiguous weights, K a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor xb = x.to(torch::kBFloat16).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    bf16dot_k::gemm_rows(xp, wp, yp, M, N, K, begin * 4, std::min(N, end * 4));
  });
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y;
#endif
}
