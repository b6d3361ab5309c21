// Helpers every splitserve CPU kernel source shares: the element types they take (float32,
// bfloat16 as raw bits, float16), loaded to and stored from float32 (bf16: round to nearest
// even, as torch rounds), and a dispatch on a tensor's dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

namespace splitserve {

using at::Tensor;

struct F32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float f) { return f; }
};

struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }
  static inline uint16_t store(float f) {  // round to nearest even, NaN stays NaN
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
};

struct F16 {
  using T = c10::Half;
  static inline float load(c10::Half v) { return float(v); }
  static inline c10::Half store(float f) { return c10::Half(f); }
};

template <class Fn>
void dispatch(const Tensor& t, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(F32{}); break;
    case at::kBFloat16: fn(BF16{}); break;
    case at::kHalf: fn(F16{}); break;
    default: TORCH_CHECK(false, "splitserve cpu kernels take float32, bfloat16 or float16, not ",
                         t.scalar_type());
  }
}

template <class D>
typename D::T* ptr(const Tensor& t) {
  return static_cast<typename D::T*>(t.data_ptr());
}

}  // namespace splitserve
