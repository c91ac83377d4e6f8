// The one extension module of the CPU kernels (built by cpu_kernels.py).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: while a step computes, the worker's
  // event loop (streaming deltas, Serve's calls) runs beside it instead of waiting for it. Arguments
  // are converted before the release and results after it, so no kernel touches a Python object.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
#ifdef __AVX2__
  m.attr("has_avx2") = true;
#else
  m.attr("has_avx2") = false;  // only the decode attention kernel has a portable path
#endif
  m.def("paged_decode_attention", &paged_decode_attention, nogil, "decode attention over a paged KV cache (CPU, float32)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0);
  m.def("paged_prefill_attention", &paged_prefill_attention, nogil,
        "prefill chunks' attention over a paged KV cache into out (CPU, float32; causal, online softmax)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("query_starts"), py::arg("query_lens"), py::arg("context_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0);
  m.def("small_m_linear", &small_m_linear, nogil, "x @ w.T (+ bias) for a few rows of x; float32 or bfloat16 weights");
  m.def("grouped_small_m_linear", &grouped_small_m_linear, nogil, "each expert's rows of x @ its w.T (a MoE layer's experts)");
  m.def("set_isa", &set_isa, "the matmul loops to run: 'avx2', 'avx512' or 'auto' (widest); returns the previous",
        py::arg("name"));
  m.def("get_isa", &get_isa, "the matmul loops that run: 'avx2' or 'avx512'");
  m.def("small_m_linear_bf16dot", &small_m_linear_bf16dot, nogil,
        "x @ w.T (+ bias), x rounded to bfloat16, bfloat16 weights (AVX512_BF16 vdpbf16ps; opt-in, not exact)");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  m.attr("has_avx512_bf16") = true;
#else
  m.attr("has_avx512_bf16") = false;
#endif
#ifdef __AVX512F__
  m.attr("has_avx512") = true;
#else
  m.attr("has_avx512") = false;
#endif
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm; with a residual, the add in place first (float32)");
  m.def("silu_and_mul", &silu_and_mul, nogil, "silu(gate) * up of [gate | up] (float32)");
  m.def("rotary_embedding", &rotary_embedding, nogil, "rotary embedding of q and k in place (float32)");
  m.def("quantize_q8_activations", &quantize_q8_activations, nogil,
        "rows of x (float32 [M, K]) as llama.cpp's block_q8_0 (q8_1: block_q8_1) -> uint8 [M, K / 32 * 34 or 36]",
        py::arg("x"), py::arg("q8_1") = false, py::arg("force_scalar") = false);
  m.def("gguf_linear", &gguf_linear, nogil,
        "x @ W.T, W gguf_pack's blocks uint8 [N, K / 32 * block bytes] of ggml_type 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0)",
        py::arg("x"), py::arg("w_blocks"), py::arg("ggml_type"), py::arg("force_scalar") = false);
  m.def("set_gguf_gemm_min_rows", &set_gguf_gemm_min_rows,
        "gguf_linear takes its GEMM tiles from this many rows of x (fewer: the GEMV); returns the previous",
        py::arg("rows"));
  m.def("gguf_pack", &gguf_pack, nogil,
        "GGUF blocks uint8 [N, row bytes] of ggml_type 2, 3 or 8 as gguf_linear takes them: each 16 rows packed "
        "for vpdpbusd (the last N % 16 as stored); unpack=True: back",
        py::arg("w_blocks"), py::arg("ggml_type"), py::arg("unpack") = false);
  m.def("gguf_packed_rows", &gguf_packed_rows, nogil, "rows ids of a packed matrix, as the file stores them",
        py::arg("w_packed"), py::arg("ids"), py::arg("ggml_type"));
  m.def("quantize_q8_k_activations", &quantize_q8_k_activations, nogil,
        "rows of x (float32 [M, K]) as llama.cpp's block_q8_K -> uint8 [M, K / 256 * 292]", py::arg("x"),
        py::arg("force_scalar") = false);
  m.def("gguf_linear_k", &gguf_linear_k, nogil,
        "x @ W.T, W GGUF K-quant super-blocks uint8 [N, K / 256 * block bytes] of ggml_type 12 (Q4_K), 13 (Q5_K) "
        "or 14 (Q6_K)",
        py::arg("x"), py::arg("w_blocks"), py::arg("ggml_type"), py::arg("force_scalar") = false);
  m.def("quantize_int8_per_token", &quantize_int8_per_token, nogil,
        "rows of x (float32 [M, K]) -> (q int8 [M, K], s float32 [M]): s = max|x row| / 127, q = round(x / s)",
        py::arg("x"), py::arg("force_scalar") = false);
  m.def("int8_linear", &int8_linear, nogil,
        "x @ (w * w_scale[:, None]).T (+ bias) with x quantized per token: w int8 [N, K], w_scale float32 [N]",
        py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("bias") = py::none(), py::arg("force_scalar") = false);
  m.def("gguf_embedding", &gguf_embedding, nogil, "rows ids of packed Q8_0 (8) or Q4_0 (2) blocks as float32 [n, cols]",
        py::arg("ids"), py::arg("w_blocks"), py::arg("ggml_type"));
  m.def("lora_add", &lora_add, nogil,
        "y[rows, off:off+out] += scalings[slot] * (x[rows] @ A[slot]) @ B[slot] per segment (start, length, slot)",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("scalings"), py::arg("segments"),
        py::arg("out_offset"));
  m.def("argmax_rows", &argmax_rows, nogil, "each row's first maximum (torch.argmax's index) of float32 [rows, n]");
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    torch::Tensor, torch::Tensor, int64_t, int64_t, double, double, std::vector<int64_t>,
                    std::vector<std::vector<int64_t>>>(),
           "weights (each tensor's parts), k_caches, v_caches, cos, sin, num_heads, num_kv_heads, eps, scale, "
           "windows, types (each part's ggml_type: 2, 3, 8, 12, 13, 14: GGUF blocks; 0: float)")
      .def("__call__", &DecodeLayers::forward, nogil, "h, positions, slot_mapping, block_tables, context_lens -> (h, residual)")
      .def("set_head", &DecodeLayers::set_head,
           "the final norm's weight and the LM head's GGUF blocks (any of the six types), for logits",
           py::arg("norm_weight"), py::arg("head_blocks"), py::arg("head_type"))
      .def("logits", &DecodeLayers::logits, nogil,
           "h, positions, slot_mapping, block_tables, context_lens, logits_indices -> float32 logits (set_head's head)")
      .def_readwrite("timing", &DecodeLayers::timing, "time each op of a layer (see op_seconds)")
      .def("op_seconds", [](DecodeLayers& d) {
        py::dict out;  // then zeroed
        for (int i = 0; i < DecodeLayers::kOps; ++i) out[DecodeLayers::kOpNames[i]] = d.op_seconds[i];
        d.op_seconds.fill(0.0);
        return out;
      }, "{op: wall seconds summed over layers and calls since the last read}, in layer order");
}
