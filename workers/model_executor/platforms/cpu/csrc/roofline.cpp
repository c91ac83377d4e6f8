// This machine's arithmetic peaks: for each instruction a CPU multiplies
// with (float32 FMA, int8 and bfloat16 dot products), a loop that does
// nothing else, over enough independent accumulators to keep every unit of
// that kind busy (latency x throughput: 4-5 cycles x 2 units, so 8-16 of
// them), on every thread given, one chunk a thread. `shoal bench roofline`
// and `bench offline` time it (benchmarks/roofline.py); a run's share of
// its arithmetic's roofline is measured against the fastest path here.
//
// Built alone as `shoal_roofline` (roofline_kernels.py), not into
// shoal_cpu_kernels. Each path is a function under its own target
// attribute, so the file builds with the project's flags (-march=native)
// on any x86-64; paths() says which the CPU (cpuid) and the OS (XCR0, and
// for AMX the arch_prctl permission) can run, and run() refuses the
// others. Elsewhere than x86-64 every path is absent.
//
// Each kernel returns, per thread, a checksum of its accumulators, each
// lane weighted by its place (1, 2, ... over the accumulators in order) so
// that a lane or an accumulator mixed up shows. The operands come from the
// formulas below (operand_a, operand_b; tests/test_roofline.py computes the
// same checksum in float64 / integers), small enough that int8 pairs never
// saturate and float sums stay exact for a test's iteration counts. Where
// GCC's code from the intrinsics was not the bare loop (the VNNI ones kept
// their accumulators on the stack), the loop body is asm; the empty asm in
// the AVX2 int8 loop keeps the compiler from computing its products, pure
// and the same every time, only once (it emits no instruction).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROOF_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace py = pybind11;

namespace {

// Operand j (flattened) of "a" (unsigned, 1..4) and of "b" variant v (signed, -3..3).
inline int operand_a(int j) { return j % 4 + 1; }
inline int operand_b(int j, int v) { return (j + 3 * v) % 7 - 3; }

struct Path {
  const char* name;
  const char* arithmetic;   // float32, int8, bfloat16
  const char* instruction;  // what the loop issues
  double ops_per_iter;      // per thread: 2 ops a multiply-add
};

// Accumulators per path: 2 units x 4-5 cycles of latency, with room to spare.
constexpr int kFmaYmm = 12, kFmaZmm = 16, kMaddYmm = 8, kMaddAcc = 4, kVnniYmm = 12, kVnniZmm = 16, kBf16Zmm = 16;

const Path kPaths[] = {
    {"avx2-fma", "float32", "vfmadd231ps ymm", 2.0 * 8 * kFmaYmm},
    {"avx512-fma", "float32", "vfmadd231ps zmm", 2.0 * 16 * kFmaZmm},
    {"avx2-maddubs", "int8", "vpmaddubsw+vpmaddwd+vpaddd ymm", 2.0 * 32 * kMaddYmm},
    {"avxvnni-dpbusd", "int8", "vpdpbusd ymm (AVX-VNNI)", 2.0 * 32 * kVnniYmm},
    {"avx512vnni-dpbusd", "int8", "vpdpbusd zmm (AVX512-VNNI)", 2.0 * 64 * kVnniZmm},
    {"amx-int8", "int8", "tdpbusd (AMX tiles)", 2.0 * 4 * 16 * 16 * 64},
    {"avx512bf16-dpbf16", "bfloat16", "vdpbf16ps zmm (AVX512-BF16)", 2.0 * 32 * kBf16Zmm},
    {"amx-bf16", "bfloat16", "tdpbf16ps (AMX tiles)", 2.0 * 4 * 16 * 16 * 32},
};

#ifdef ROOF_X86

// ---- what this CPU and OS can run ----

struct Cpu {
  bool avx2 = false, fma = false, avx512f = false, avx512vnni = false, avxvnni = false, avx512bf16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;
};

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

Cpu detect() {
  Cpu c;
  unsigned a, b, cx, d;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
  c.fma = cx & (1u << 12);
  if (cx & (1u << 27)) {  // OSXSAVE: XCR0 says which register states the OS saves
    const uint64_t x = xcr0();
    c.os_avx = (x & 0x6) == 0x6;                           // SSE, AVX
    c.os_avx512 = c.os_avx && (x & 0xe0) == 0xe0;          // opmask, ZMM_Hi256, Hi16_ZMM
    c.os_amx = (x & 0x60000) == 0x60000;                   // XTILECFG, XTILEDATA
  }
  if (__get_cpuid_max(0, nullptr) < 7) return c;
  __cpuid_count(7, 0, a, b, cx, d);
  const unsigned max_sub = a;
  c.avx2 = b & (1u << 5);
  c.avx512f = b & (1u << 16);
  c.avx512vnni = cx & (1u << 11);
  c.amx_bf16 = d & (1u << 22);
  c.amx_tile = d & (1u << 24);
  c.amx_int8 = d & (1u << 25);
  if (max_sub >= 1) {
    __cpuid_count(7, 1, a, b, cx, d);
    c.avxvnni = a & (1u << 4);
    c.avx512bf16 = a & (1u << 5);
  }
  return c;
}

const Cpu& cpu() {
  static const Cpu c = detect();
  return c;
}

// Linux hands out the AMX tile data state only on request, once a process.
bool amx_permitted() {
  static const bool ok = [] {
#ifdef SYS_arch_prctl
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// Why a path cannot run here ("" when it can).
std::string absent_why(const std::string& name) {
  const Cpu& c = cpu();
  auto need = [](bool have, const char* what) { return have ? std::string() : std::string("no ") + what; };
  std::string why;
  if (name == "avx2-fma") why = need(c.avx2 && c.fma && c.os_avx, "AVX2+FMA");
  else if (name == "avx2-maddubs") why = need(c.avx2 && c.os_avx, "AVX2");
  else if (name == "avxvnni-dpbusd") why = need(c.avxvnni && c.os_avx, "AVX-VNNI");
  else if (name == "avx512-fma") why = need(c.avx512f && c.os_avx512, "AVX-512F");
  else if (name == "avx512vnni-dpbusd") why = need(c.avx512f && c.avx512vnni && c.os_avx512, "AVX512-VNNI");
  else if (name == "avx512bf16-dpbf16") why = need(c.avx512f && c.avx512bf16 && c.os_avx512, "AVX512-BF16");
  else if (name == "amx-bf16" || name == "amx-int8") {
    const bool have = c.amx_tile && (name == "amx-bf16" ? c.amx_bf16 : c.amx_int8);
    why = need(have, name == "amx-bf16" ? "AMX-BF16" : "AMX-INT8");
    if (why.empty() && !c.os_amx) why = "the OS does not enable AMX tile state";
    else if (why.empty() && !amx_permitted()) why = "the OS refused the AMX tile permission (arch_prctl)";
  } else {
    throw std::invalid_argument("unknown roofline path '" + name + "'");
  }
  return why;
}

// Keeps the compiler from treating v as unchanged since its last use; emits nothing.
#define ROOF_OPAQUE(v) __asm__ volatile("" : "+v"(v))

// ---- float32 FMA ----

__attribute__((target("avx2,fma"))) double fma_ymm(int64_t iters) {
  alignas(32) float xs[8], ys[2][8];
  for (int l = 0; l < 8; ++l) {
    xs[l] = 0.5f * operand_a(l);
    for (int v = 0; v < 2; ++v) ys[v][l] = 0.25f * operand_b(l, v);
  }
  const __m256 x = _mm256_load_ps(xs), y0 = _mm256_load_ps(ys[0]), y1 = _mm256_load_ps(ys[1]);
  __m256 acc[kFmaYmm];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kFmaYmm; ++k) acc[k] = _mm256_fmadd_ps(x, k % 2 ? y1 : y0, acc[k]);
  }
  double sum = 0;
  alignas(32) float out[8];
  for (int k = 0; k < kFmaYmm; ++k) {
    _mm256_store_ps(out, acc[k]);
    for (int l = 0; l < 8; ++l) sum += double(k * 8 + l + 1) * out[l];
  }
  return sum;
}

__attribute__((target("avx512f"))) double fma_zmm(int64_t iters) {
  alignas(64) float xs[16], ys[2][16];
  for (int l = 0; l < 16; ++l) {
    xs[l] = 0.5f * operand_a(l);
    for (int v = 0; v < 2; ++v) ys[v][l] = 0.25f * operand_b(l, v);
  }
  const __m512 x = _mm512_load_ps(xs), y0 = _mm512_load_ps(ys[0]), y1 = _mm512_load_ps(ys[1]);
  __m512 acc[kFmaZmm];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kFmaZmm; ++k) acc[k] = _mm512_fmadd_ps(x, k % 2 ? y1 : y0, acc[k]);
  }
  double sum = 0;
  alignas(64) float out[16];
  for (int k = 0; k < kFmaZmm; ++k) {
    _mm512_store_ps(out, acc[k]);
    for (int l = 0; l < 16; ++l) sum += double(k * 16 + l + 1) * out[l];
  }
  return sum;
}

// ---- int8 dot products: u8 x s8, 4 products summed into each int32 lane ----

template <int N>
void int8_operands(uint8_t (&a)[N], int8_t (&b)[2][N]) {
  for (int j = 0; j < N; ++j) {
    a[j] = uint8_t(operand_a(j));
    for (int v = 0; v < 2; ++v) b[v][j] = int8_t(operand_b(j, v));
  }
}

__attribute__((target("avx2"))) int64_t sum_epi32(const __m256i* acc, int n) {
  int64_t sum = 0;
  alignas(32) int32_t out[8];
  for (int k = 0; k < n; ++k) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[k]);
    for (int l = 0; l < 8; ++l) sum += int64_t(k * 8 + l + 1) * out[l];
  }
  return sum;
}

// As the AVX2 int8 GEMMs (llama.cpp's, int8_gemm.cpp) do it: u8 x s8 pairs
// to int16, pairs of those to int32 against ones, added to the accumulator.
__attribute__((target("avx2"))) double maddubs_ymm(int64_t iters) {
  alignas(32) uint8_t as[32];
  alignas(32) int8_t bs[2][32];
  int8_operands(as, bs);
  __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(as));
  const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs[0]));
  const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs[1]));
  const __m256i ones = _mm256_set1_epi16(1);
  // Only the (1-cycle) add is carried from one trip to the next: 4 accumulators, 2 products each a trip.
  __m256i acc[kMaddAcc];
  for (auto& c : acc) c = _mm256_setzero_si256();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kMaddYmm; ++k) {
      ROOF_OPAQUE(a);  // else the products, the same each time, would be computed once
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, k % 2 ? b1 : b0), ones);
      acc[k % kMaddAcc] = _mm256_add_epi32(acc[k % kMaddAcc], p);
    }
  }
  return double(sum_epi32(acc, kMaddAcc));
}

__attribute__((target("avx2,avxvnni"))) double vnni_ymm(int64_t iters) {
  alignas(32) uint8_t as[32];
  alignas(32) int8_t bs[2][32];
  int8_operands(as, bs);
  const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(as));
  const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs[0]));
  const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs[1]));
  // In asm: from the intrinsics GCC 12 stored every accumulator to the stack each trip.
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
          c9 = c0, c10 = c0, c11 = c0;
  for (int64_t i = 0; i < iters; ++i) {
    __asm__(
        "%{vex%} vpdpbusd %[b0], %[a], %[c0]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c1]\n\t"
        "%{vex%} vpdpbusd %[b0], %[a], %[c2]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c3]\n\t"
        "%{vex%} vpdpbusd %[b0], %[a], %[c4]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c5]\n\t"
        "%{vex%} vpdpbusd %[b0], %[a], %[c6]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c7]\n\t"
        "%{vex%} vpdpbusd %[b0], %[a], %[c8]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c9]\n\t"
        "%{vex%} vpdpbusd %[b0], %[a], %[c10]\n\t%{vex%} vpdpbusd %[b1], %[a], %[c11]"
        : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5),
          [c6] "+x"(c6), [c7] "+x"(c7), [c8] "+x"(c8), [c9] "+x"(c9), [c10] "+x"(c10), [c11] "+x"(c11)
        : [a] "x"(a), [b0] "x"(b0), [b1] "x"(b1));
  }
  const __m256i acc[kVnniYmm] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  return double(sum_epi32(acc, kVnniYmm));
}

__attribute__((target("avx512f,avx512vnni"))) double vnni_zmm(int64_t iters) {
  alignas(64) uint8_t as[64];
  alignas(64) int8_t bs[2][64];
  int8_operands(as, bs);
  const __m512i a = _mm512_load_si512(as);
  const __m512i b0 = _mm512_load_si512(bs[0]), b1 = _mm512_load_si512(bs[1]);
  // In asm, as vnni_ymm; two statements, as one asm takes at most 30 operands (a "+" one counts twice).
  __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
          c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
#define ROOF_DPBUSD_ZMM8(x0, x1, x2, x3, x4, x5, x6, x7)                                                 \
  __asm__(                                                                                               \
      "vpdpbusd %[b0], %[a], %[d0]\n\tvpdpbusd %[b1], %[a], %[d1]\n\t"                                  \
      "vpdpbusd %[b0], %[a], %[d2]\n\tvpdpbusd %[b1], %[a], %[d3]\n\t"                                  \
      "vpdpbusd %[b0], %[a], %[d4]\n\tvpdpbusd %[b1], %[a], %[d5]\n\t"                                  \
      "vpdpbusd %[b0], %[a], %[d6]\n\tvpdpbusd %[b1], %[a], %[d7]"                                        \
      : [d0] "+v"(x0), [d1] "+v"(x1), [d2] "+v"(x2), [d3] "+v"(x3), [d4] "+v"(x4), [d5] "+v"(x5),         \
        [d6] "+v"(x6), [d7] "+v"(x7)                                                                     \
      : [a] "v"(a), [b0] "v"(b0), [b1] "v"(b1))
  for (int64_t i = 0; i < iters; ++i) {
    ROOF_DPBUSD_ZMM8(c0, c1, c2, c3, c4, c5, c6, c7);
    ROOF_DPBUSD_ZMM8(c8, c9, c10, c11, c12, c13, c14, c15);
  }
#undef ROOF_DPBUSD_ZMM8
  const __m512i acc[kVnniZmm] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};
  int64_t sum = 0;
  alignas(64) int32_t out[16];
  for (int k = 0; k < kVnniZmm; ++k) {
    _mm512_store_si512(out, acc[k]);
    for (int l = 0; l < 16; ++l) sum += int64_t(k * 16 + l + 1) * out[l];
  }
  return double(sum);
}

// ---- bfloat16 dot products: pairs of bfloat16 products into each float32 lane ----

uint16_t to_bf16(float f) {  // exact for the operands used (few mantissa bits)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_zmm(int64_t iters) {
  alignas(64) uint16_t as[32], bs[2][32];
  for (int j = 0; j < 32; ++j) {
    as[j] = to_bf16(0.5f * operand_a(j));
    for (int v = 0; v < 2; ++v) bs[v][j] = to_bf16(0.25f * operand_b(j, v));
  }
  const __m512bh a = (__m512bh)_mm512_load_si512(as);
  const __m512bh b0 = (__m512bh)_mm512_load_si512(bs[0]), b1 = (__m512bh)_mm512_load_si512(bs[1]);
  __m512 acc[kBf16Zmm];
  for (auto& c : acc) c = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kBf16Zmm; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], a, k % 2 ? b1 : b0);
  }
  double sum = 0;
  alignas(64) float out[16];
  for (int k = 0; k < kBf16Zmm; ++k) {
    _mm512_store_ps(out, acc[k]);
    for (int l = 0; l < 16; ++l) sum += double(k * 16 + l + 1) * out[l];
  }
  return sum;
}

// ---- AMX: 4 accumulating 16x16 tiles (C0..C3 = A0|A1 x B0|B1, oneDNN's 2x2 blocking) ----

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A tiles hold operand_a row-major (16 rows of 64 bytes), B tiles operand_b variant 0 and 1 in the
// VNNI layout the instruction reads: a row of B holds the 2 (bf16) or 4 (int8) consecutive k of each column.
template <bool kInt8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) double amx_tiles(int64_t iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  alignas(64) uint8_t a[16 * 64], b[2][16 * 64];
  for (int j = 0; j < (kInt8 ? 1024 : 512); ++j) {
    if (kInt8) {
      a[j] = uint8_t(operand_a(j));
      for (int v = 0; v < 2; ++v) b[v][j] = uint8_t(int8_t(operand_b(j, v)));
    } else {
      const uint16_t x = to_bf16(0.5f * operand_a(j));
      std::memcpy(a + 2 * j, &x, 2);
      for (int v = 0; v < 2; ++v) {
        const uint16_t y = to_bf16(0.25f * operand_b(j, v));
        std::memcpy(b[v] + 2 * j, &y, 2);
      }
    }
  }
  alignas(64) uint8_t c[16 * 64] = {};
  _tile_loadconfig(&cfg);  // per thread: tile state is a thread's
  _tile_loadd(0, c, 64);
  _tile_loadd(1, c, 64);
  _tile_loadd(2, c, 64);
  _tile_loadd(3, c, 64);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b[0], 64);
  _tile_loadd(7, b[1], 64);
  for (int64_t i = 0; i < iters; ++i) {
    if (kInt8) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  double sum = 0;
  auto add = [&](int t) {  // C tile t's 16 x 16, weighted as the vector paths' lanes
    for (int j = 0; j < 256; ++j) {
      double v;
      if (kInt8) {
        int32_t x;
        std::memcpy(&x, c + 4 * j, 4);
        v = x;
      } else {
        float x;
        std::memcpy(&x, c + 4 * j, 4);
        v = x;
      }
      sum += double(t * 256 + j + 1) * v;
    }
  };
  _tile_stored(0, c, 64);
  add(0);
  _tile_stored(1, c, 64);
  add(1);
  _tile_stored(2, c, 64);
  add(2);
  _tile_stored(3, c, 64);
  add(3);
  _tile_release();
  return sum;
}

using Kernel = double (*)(int64_t);

Kernel kernel_of(const std::string& name) {
  if (name == "avx2-fma") return fma_ymm;
  if (name == "avx512-fma") return fma_zmm;
  if (name == "avx2-maddubs") return maddubs_ymm;
  if (name == "avxvnni-dpbusd") return vnni_ymm;
  if (name == "avx512vnni-dpbusd") return vnni_zmm;
  if (name == "avx512bf16-dpbf16") return dpbf16_zmm;
  if (name == "amx-bf16") return amx_tiles<false>;
  if (name == "amx-int8") return amx_tiles<true>;
  throw std::invalid_argument("unknown roofline path '" + name + "'");
}

#else  // not x86-64

std::string absent_why(const std::string& name) {
  for (const Path& p : kPaths)
    if (name == p.name) return "not an x86-64 build";
  throw std::invalid_argument("unknown roofline path '" + name + "'");
}

using Kernel = double (*)(int64_t);
Kernel kernel_of(const std::string&) { return nullptr; }

#endif

py::list paths() {
  py::list out;
  for (const Path& p : kPaths) {
    const std::string why = absent_why(p.name);
    py::dict d;
    d["name"] = p.name;
    d["arithmetic"] = p.arithmetic;
    d["instruction"] = p.instruction;
    d["ops_per_iter"] = p.ops_per_iter;
    d["present"] = why.empty();
    d["absent"] = why;
    out.append(d);
  }
  return out;
}

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// `iters` loop trips of the path on `threads` threads at once (one chunk each).
// Returns each thread's checksum and the CPU seconds its loop took, in thread
// order: on a machine shared with other work the CPU time gives the rate a
// core reaches while it runs the loop, which wall time understates.
std::pair<std::vector<double>, std::vector<double>> run(const std::string& name, int64_t iters, int threads) {
  const std::string why = absent_why(name);
  if (!why.empty()) throw std::invalid_argument("roofline path '" + name + "' is absent here: " + why);
  if (iters < 0 || threads < 1) throw std::invalid_argument("run: iters >= 0 and threads >= 1");
  const Kernel kernel = kernel_of(name);
  std::vector<double> sums(threads, 0.0), cpu_s(threads, 0.0);
  std::vector<int> ran(threads, 0);
  {
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const double t0 = thread_cpu_seconds();
      sums[t] = kernel(iters);
      cpu_s[t] = thread_cpu_seconds() - t0;
      ran[t] = 1;
    }
  }
  for (int t = 0; t < threads; ++t)
    if (!ran[t]) throw std::runtime_error("run: OpenMP gave fewer threads than asked");
  return {sums, cpu_s};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "peak-rate loops for float32 FMA, int8 and bfloat16 dot products (bench roofline)";
  m.def("paths", &paths, "every path: name, arithmetic, instruction, ops_per_iter, present, absent (why)");
  m.def("run", &run, py::arg("name"), py::arg("iters"), py::arg("threads"),
        "iters loop trips of one path on `threads` threads: (each thread's checksum, each thread's CPU seconds)");
}
