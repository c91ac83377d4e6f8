// The fp16 scales of GGUF blocks, read as float32 (F16C where the CPU has
// it, rounding as ggml's), shared by gguf_gemv.cpp and gguf_kquants.cpp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#ifdef __F16C__
#include <immintrin.h>
#endif

inline float fp16_load(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
