// The grouped LoRA update of one fused part in one call (workers/lora/ops.py's
// add_lora, Punica's SGMV on the CPU): for each segment of rows under one
// adapter slot, y[rows, off : off + out] += scaling[slot] * (x[rows] A[slot]) B[slot].
//
// The torch path spends some five small ops a segment a part, thousands a
// decode step under eight adapters; this walks every segment of the part in
// one call, reads each adapter's A and B once per 8 rows, and widens
// bfloat16 slots as it reads them. Products accumulate in float32.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 8;     // rows of x a work item takes
constexpr int64_t kCols = 256;   // output columns an expand item takes
constexpr int64_t kMaxRank = 256;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Item {
  int64_t row, rows, slot;  // rows [row, row + rows) of x, all under `slot`
};

// s [rows, R] = x[rows] A[slot]  (A [in, R] row-major: one row of A a step, all rows' sums at once)
template <typename W>
void shrink(const float* x, int64_t ldx, const W* a, int64_t in, int64_t R, int64_t rows, float* s) {
  float acc[kRows][kMaxRank];
  for (int64_t m = 0; m < rows; ++m) std::fill(acc[m], acc[m] + R, 0.0f);
  float arow[kMaxRank];
  for (int64_t k = 0; k < in; ++k) {
    const W* ak = a + k * R;
    for (int64_t r = 0; r < R; ++r) arow[r] = widen(ak[r]);
    for (int64_t m = 0; m < rows; ++m) {
      const float xv = x[m * ldx + k];
      float* am = acc[m];
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) am[r] += xv * arow[r];
    }
  }
  for (int64_t m = 0; m < rows; ++m) std::memcpy(s + m * R, acc[m], R * sizeof(float));
}

// y[rows, c0:c1] += scale * s[rows] B[slot][:, c0:c1]  (B [R, out] row-major)
template <typename W>
void expand(const float* s, const W* b, int64_t R, int64_t out, int64_t c0, int64_t c1, int64_t rows, float scale,
            float* y, int64_t ldy) {
  float acc[kRows][kCols];
  const int64_t n = c1 - c0;
  for (int64_t m = 0; m < rows; ++m) std::fill(acc[m], acc[m] + n, 0.0f);
  float brow[kCols];
  for (int64_t r = 0; r < R; ++r) {
    const W* br = b + r * out + c0;
    for (int64_t c = 0; c < n; ++c) brow[c] = widen(br[c]);
    for (int64_t m = 0; m < rows; ++m) {
      const float sv = s[m * R + r];
      if (sv == 0.0f) continue;  // a padded rank column: exact zeros
      float* am = acc[m];
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) am[c] += sv * brow[c];
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* ym = y + m * ldy + c0;
    const float* am = acc[m];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) ym[c] += am[c] * scale;
  }
}

// The fast path, for ranks and output widths in multiples of 16: 16 floats a
// vector (GCC's vector extension: one AVX-512 register, or two AVX2 ones), 8
// rows' sums in 8 registers. Rows past an item's own read a zero row.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t w16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const at::BFloat16* p) {
  w16 w = __builtin_convertvector(*reinterpret_cast<const h16*>(p), w16) << 16;
  return reinterpret_cast<v16&>(w);
}

template <typename W>
void shrink16(const float* const* xr, const W* a, int64_t in, int64_t R, int64_t rows, float* s) {
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    v16 acc[kRows] = {};
    for (int64_t k = 0; k < in; ++k) {
      const v16 av = load16(a + k * R + r0);
      for (int m = 0; m < kRows; ++m) acc[m] += xr[m][k] * av;
    }
    for (int64_t m = 0; m < rows; ++m) *reinterpret_cast<v16*>(s + m * R + r0) = acc[m];
  }
}

template <typename W>
void expand16(const float* s, const W* b, int64_t R, int64_t out, int64_t rows, float scale, float* y, int64_t ldy) {
  for (int64_t c = 0; c < out; c += 16) {
    v16 acc[kRows] = {};
    for (int64_t r = 0; r < R; ++r) {
      const v16 bv = load16(b + r * out + c);
      for (int m = 0; m < kRows; ++m) acc[m] += s[m * R + r] * bv;
    }
    for (int64_t m = 0; m < rows; ++m) {
      v16* ym = reinterpret_cast<v16*>(y + m * ldy + c);
      *ym += acc[m] * scale;
    }
  }
}

template <typename W>
void run(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
         const float* scalings, const std::vector<Item>& items, int64_t out_offset) {
  const int64_t in = x.size(1), R = a.size(2), out = b.size(2), ldx = x.stride(0), ldy = y.stride(0);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>() + out_offset;
  const W* ap = a.data_ptr<W>();
  const W* bp = b.data_ptr<W>();
  const int64_t n_items = static_cast<int64_t>(items.size());
  // One pass a work item (up to kRows rows of one slot): its shrink, then its expand over every column
  // block. One fork a call: a decode step makes ~200 of these calls, each a few hundred KB of A and B.
  const bool fast = R % 16 == 0 && out % 16 == 0;
  std::vector<float> zeros(fast ? in : 0, 0.0f);
  at::parallel_for(0, n_items, 1, [&](int64_t i0, int64_t i1) {
    float s[kRows * kMaxRank];
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      if (fast) {
        const float* xr[kRows];
        for (int64_t m = 0; m < kRows; ++m) xr[m] = m < it.rows ? xp + (it.row + m) * ldx : zeros.data();
        std::fill(s, s + kRows * R, 0.0f);
        shrink16(xr, ap + it.slot * in * R, in, R, it.rows, s);
        expand16(s, bp + it.slot * R * out, R, out, it.rows, scalings[it.slot], yp + it.row * ldy, ldy);
        continue;
      }
      shrink(xp + it.row * ldx, ldx, ap + it.slot * in * R, in, R, it.rows, s);
      for (int64_t c0 = 0; c0 < out; c0 += kCols) {
        expand(s, bp + it.slot * R * out, R, out, c0, std::min(out, c0 + kCols), it.rows, scalings[it.slot],
               yp + it.row * ldy, ldy);
      }
    }
  });
}

}  // namespace

void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor scalings,
              torch::Tensor segments, int64_t out_offset) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x and y must be [T, *] alike");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "lora_add: x and y must be float32");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add: x and y rows must be contiguous");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_add: A [slots, in, R] and B [slots, R, out] must be contiguous");
  TORCH_CHECK(lora_a.scalar_type() == lora_b.scalar_type(), "lora_add: A and B must share a dtype");
  const int64_t slots = lora_a.size(0), in = lora_a.size(1), R = lora_a.size(2), out = lora_b.size(2);
  TORCH_CHECK(x.size(1) == in && lora_b.size(0) == slots && lora_b.size(1) == R, "lora_add: shapes disagree");
  TORCH_CHECK(R <= kMaxRank, "lora_add: rank above ", kMaxRank);
  TORCH_CHECK(out_offset >= 0 && out_offset + out <= y.size(1), "lora_add: output columns outside y");
  TORCH_CHECK(scalings.scalar_type() == at::kFloat && scalings.is_contiguous() && scalings.numel() == slots,
              "lora_add: scalings must be float32 [slots]");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora_add: segments must be int64 [S, 3] (start, length, slot)");
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int64_t start = seg[3 * i], len = seg[3 * i + 1], slot = seg[3 * i + 2];
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= x.size(0) && slot >= 0 && slot < slots,
                "lora_add: segment ", i, " outside x or the slots");
    for (int64_t r = 0; r < len; r += kRows) items.push_back({start + r, std::min(kRows, len - r), slot});
  }
  if (items.empty()) return;
  const float* sc = scalings.data_ptr<float>();
  if (lora_a.scalar_type() == at::kFloat) {
    run<float>(y, x, lora_a, lora_b, sc, items, out_offset);
  } else {
    TORCH_CHECK(lora_a.scalar_type() == at::kBFloat16, "lora_add: slots must be float32 or bfloat16");
    run<at::BFloat16>(y, x, lora_a, lora_b, sc, items, out_offset);
  }
}
