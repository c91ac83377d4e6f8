// The CPU kernels' entry points, for the bindings and for kernels that
// compose them (cpu_decode_layers.cpp).
#pragma once
#include <torch/extension.h>
#include <array>
#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window);
// Prefill chunks against the paged cache (paged_prefill_cpu.cpp), into out [T, H, D]:
// chunk c is q's rows query_starts[c] .. + query_lens[c], the last of its
// context_lens[c] positions, keys in blocks block_tables[c] (int64 [chunks, max_blocks]).
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                             torch::Tensor context_lens, double scale, int64_t sliding_window);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor grouped_small_m_linear(torch::Tensor x, torch::Tensor w, torch::Tensor offsets);
// Which build of small_m_linear's loops runs: "avx2", "avx512" or "auto"
// (the widest compiled in; also SHOAL_CPU_ISA at load). Returns the previous one.
std::string set_isa(const std::string& name);
std::string get_isa();
// x @ w.T (+ bias) with x rounded to bfloat16 and vdpbf16ps (AVX512_BF16):
// bfloat16 weights only, an explicit opt-in (not float32-exact).
torch::Tensor small_m_linear_bf16dot(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
// GGUF block weights (csrc/gguf_gemv.cpp): 8-bit activations as llama.cpp
// (block_q8_0, or block_q8_1 for Q4_1), integer block dot products.
torch::Tensor quantize_q8_activations(torch::Tensor x, bool q8_1, bool force_scalar);
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w_blocks, int64_t ggml_type, bool force_scalar);
// GGUF K-quant weights (csrc/gguf_kquants.cpp): Q4_K / Q5_K / Q6_K super-blocks against
// block_q8_K activations, as llama.cpp.
torch::Tensor quantize_q8_k_activations(torch::Tensor x, bool force_scalar);
torch::Tensor gguf_linear_k(torch::Tensor x, torch::Tensor w_blocks, int64_t ggml_type, bool force_scalar);
// Rows ids of Q8_0 or Q4_0 blocks, dequantized (the decode step's embedding lookup).
torch::Tensor gguf_embedding(torch::Tensor ids, torch::Tensor w_blocks, int64_t ggml_type);
// gguf_linear's weights: the file's blocks packed in groups of 16 rows (unpack: back).
torch::Tensor gguf_pack(torch::Tensor w_blocks, int64_t ggml_type, bool unpack);
torch::Tensor gguf_packed_rows(torch::Tensor w_packed, torch::Tensor ids, int64_t ggml_type);
// gguf_linear's GEMM tiles run from this many rows of x (the GEMV below); returns the previous.
int64_t set_gguf_gemm_min_rows(int64_t rows);
// INT8 W8A8 (csrc/int8_gemm.cpp): x quantized per token (symmetric, max|x| / 127),
// int8 [N, K] weights with per-row float32 scales, exact int32 dot products.
std::vector<torch::Tensor> quantize_int8_per_token(torch::Tensor x, bool force_scalar);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                          bool force_scalar);

// The grouped LoRA update of one fused part (csrc/lora_cpu.cpp): per segment
// (int64 [S, 3]: start, length, slot) y[rows, off : off + out] +=
// scalings[slot] * (x[rows] A[slot]) B[slot]; x, y float32, A and B float32 or bfloat16.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor scalings,
              torch::Tensor segments, int64_t out_offset);

// Serial pieces of the kernels above, for the one-call decode step, which
// splits them across its threads itself.

// Weight rows [n0, n1) of y [M, N] = x [M, K] w^T (+ bias), w float32 or
// bfloat16 [N, K]; for bfloat16 weights, x rows through interleave_for_bf16.
void linear_rows(const float* x, const torch::Tensor& w, const float* bias, float* y, int64_t M, int64_t n0,
                 int64_t n1);
// GGUF blocks (gguf_gemv.cpp) in gguf_linear's pieces, with its bits:
// rows [m0, m1) of x [M, K] to activation blocks (gguf_act_row_bytes a row),
// then weight rows [n0, n1) of a matrix of N rows into y [M, ldy] from them.
// ggml_type 2, 3 or 8.
int64_t gguf_weight_block_bytes(int64_t ggml_type);  // 0: not one of the three
int64_t gguf_act_row_bytes(int64_t ggml_type, int64_t K);
void gguf_quantize_rows(const float* x, uint8_t* out, int64_t K, int64_t ggml_type, int64_t m0, int64_t m1);
void gguf_linear_rows(const uint8_t* xq, const uint8_t* w, int64_t ggml_type, float* y, int64_t ldy, int64_t M,
                      int64_t N, int64_t K, int64_t n0, int64_t n1);
// The same for the K-quants (gguf_kquants.cpp: gguf_linear_k's pieces):
// block_q8_K activations, ggml_type 12, 13 or 14.
int64_t gguf_k_block_bytes(int64_t ggml_type);  // 0: not one of the three
int64_t gguf_k_act_row_bytes(int64_t K);
void gguf_k_quantize_rows(const float* x, uint8_t* out, int64_t K, int64_t m0, int64_t m1);
void gguf_k_linear_rows(const uint8_t* xq, const uint8_t* w, int64_t ggml_type, float* y, int64_t ldy, int64_t M,
                        int64_t K, int64_t n0, int64_t n1);
// One row of x in the lane order of the bfloat16 weight loads.
void interleave_for_bf16(const float* x, float* out, int64_t K);
// out = w * r / rms(r).
void norm_row(const float* r, const float* w, float* out, int64_t n, float eps);
// o[i] = silu(g[i]) * g[N + i].
void silu_mul_row(const float* g, float* o, int64_t N);
// The rotary embedding of one token's heads, in place.
void rotate(float* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin, int64_t D);

// One decode attention: query rows of q (row stride q_row) against the
// paged cache, into out (row stride out_row); a job is (sequence, KV head).
struct PagedAttn {
  const float* q;
  int64_t q_row;
  float* out;
  int64_t out_row;
  const float* k_cache;
  const float* v_cache;
  const int64_t* tables;
  int64_t max_blocks;
  const int64_t* lens;
  int64_t H, KVH, D, bs;
  float scale;
  int64_t window;  // > 0: a query sees only its last `window` positions (itself included); 0: all
};
// Query heads [g0, g1) of the job's group (all G of them: 0, H / KVH).
void attend_job(const PagedAttn& a, int64_t job, std::vector<float>& scores, std::vector<float>& acc, int64_t g0,
                int64_t g1);

// Every decoder layer of a Llama-family model for a step of decodes
// (cpu_decode_layers.cpp). Built once per model and KV cache: the 10
// tensors of each layer (an absent bias is an empty tensor), its caches and
// its sliding window (0: none). Each tensor comes as a list of parts with
// one ggml_type each: a weight matrix as float (0, one part) or as uint8
// GGUF blocks (2, 3, 8, 12, 13 or 14), one part for each run of rows in one
// type (a fused layer whose q, k and v differ); anything else one float part.
struct DecodeLayers {
  // One run of a weight matrix's rows in one type, from output row `offset`.
  struct Part {
    torch::Tensor w;
    int64_t type, rows, offset;
  };
  DecodeLayers(std::vector<std::vector<torch::Tensor>> weights, std::vector<torch::Tensor> k_caches,
               std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
               int64_t num_kv_heads, double eps, double scale, std::vector<int64_t> windows,
               std::vector<std::vector<int64_t>> types);
  std::vector<torch::Tensor> forward(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                     torch::Tensor block_tables, torch::Tensor context_lens);
  // The model's final norm and its LM head as GGUF blocks (ggml_type 2, 3,
  // 8, 12, 13 or 14), for `logits`: the layers, then both at logits_indices' rows, in
  // the one parallel region -> float32 logits [rows, head rows].
  void set_head(torch::Tensor norm_weight, torch::Tensor head_blocks, int64_t head_type);
  torch::Tensor logits(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                       torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor logits_indices);
  int64_t cols(size_t i) const;  // the input features of weight matrix i
  int64_t rows(size_t i) const;  // its output features

  std::vector<std::vector<Part>> parts;  // each tensor's
  std::vector<torch::Tensor> k_caches, v_caches;
  std::vector<int64_t> windows;
  Part head;  // set_head's (w undefined until then)
  torch::Tensor head_norm;
  torch::Tensor cos, sin;
  int64_t num_heads, num_kv_heads;
  double eps, scale;

  // While `timing` is on (bench latency --profile), the wall seconds of each
  // op of a layer, in the order of kOpNames, summed over layers and calls:
  // thread 0's time from one barrier to the next, so a thread's wait for
  // the other counts with the op it waits on.
  static constexpr int kOps = 9;
  static const char* const kOpNames[kOps];
  bool timing = false;
  std::array<double, kOps> op_seconds{};

 private:
  // forward and logits: the layers, then, with li (logits_indices), the final norm and the head: {logits}.
  std::vector<torch::Tensor> run(torch::Tensor h, torch::Tensor positions, torch::Tensor slot_mapping,
                                 torch::Tensor block_tables, torch::Tensor context_lens, const torch::Tensor* li);
};
// Each row's argmax (the first of equal maxima, the first NaN where there is
// one: torch.argmax's), of float32 [rows, n] -> int64 [rows]; the greedy
// sampler's, about 10x torch's at a vocabulary row.
torch::Tensor argmax_rows(torch::Tensor x);
