// The small per-layer ops of a step, one call each where torch's eager
// path launches several: RMSNorm with the residual add, SiLU-and-multiply
// and the rotary embedding. float32 only; the math is transformers' (the
// same operations, in float32), so results agree with the torch path to
// rounding. Rows are split across threads only when there are enough of
// them to pay for waking the threads (grain below).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "avx2_math.h"

namespace {
constexpr int64_t kRowGrain = 16;

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              what, ": float32 [rows, hidden] with unit stride along hidden");
}

}  // namespace

void norm_row(const float* r, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(r + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum256(acc);
#endif
  for (; i < n; ++i) ss += r[i] * r[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = w[j] * (r[j] * inv);
}

// x: [T, H]. Without residual: a new tensor norm(x). With one: residual += x
// in place, and x is overwritten with norm(residual) (vLLM's fused_add_rms_norm).
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32 && weight.numel() == H,
              "rms_norm: a float32 weight of the hidden size");
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (!residual.has_value()) {
    auto out = torch::empty({T, H}, x.options());
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t end) {
      for (int64_t t = b; t < end; ++t) norm_row(xp + t * x.stride(0), w, op + t * H, H, e);
    });
    return out;
  }
  check_rows(*residual, "rms_norm residual");
  TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual and x must have the same shape");
  float* xp = x.data_ptr<float>();
  float* rp = residual->data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual->stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      float* r = rp + t * rs;
      float* xr = xp + t * xs;
      for (int64_t j = 0; j < H; ++j) r[j] += xr[j];
      norm_row(r, w, xr, H, e);
    }
  });
  return x;
}

void silu_mul_row(const float* g, float* o, int64_t N) {
  const float* u = g + N;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= N; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < N; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// x: [T, 2N] = [gate | up] -> [T, N] silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: [gate | up] needs an even width");
  const int64_t T = x.size(0), N = x.size(1) / 2;
  auto out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      silu_mul_row(xp + t * xs, op + t * N, N);
    }
  });
  return out;
}

// Hugging Face's rotate_half layout: dim i pairs with i + D/2.
void rotate(float* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// q: [T, Hq, D], k: [T, Hk, D] (views into the fused q/k/v output are fine:
// unit stride along D) rotated in place by cos/sin [max_pos, D] at positions [T].
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                      torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && q.stride(2) == 1 &&
                  k.stride(2) == 1, "rotary_embedding: float32 q and k with unit stride along head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  positions.scalar_type() == torch::kInt64, "rotary_embedding: float32 tables, int64 positions");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  positions.numel() == q.size(0), "rotary_embedding: q [T, Hq, D], k [T, Hk, D], T positions");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "rotary_embedding: tables [max_pos, D]");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding: position out of range");
  at::parallel_for(0, T, kRowGrain, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      rotate(qp + t * q.stride(0), q.size(1), q.stride(1), c, s, D);
      rotate(kp + t * k.stride(0), k.size(1), k.stride(1), c, s, D);
    }
  });
}
