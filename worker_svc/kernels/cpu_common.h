// Helpers every splitserve CPU kernel source shares: the element types they take (float32,
// bfloat16 as raw bits, float16), loaded to and stored from float32 (bf16: round to nearest
// even, as torch rounds), the fp8 KV-cache formats (loaded only), and dispatches on a tensor's
// dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
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

// float8_e4m3fn (bias 7, no infinities, NaN = 0x7f/0xff) and float8_e5m2 (bias 15, IEEE-like)
// to float32, exactly and without branches (the selects compile to blends, so loops over them
// vectorise): a normal value's exponent is moved into place, a subnormal (exponent field 0) is
// its mantissa x 2^(1 - BIAS - MANTISSA) (2^-9, 2^-16).
template <int MANTISSA, int BIAS>
struct FP8 {
  using T = uint8_t;
  static constexpr uint32_t EXPONENT_SHIFT = uint32_t(127 - BIAS) << 23;
  static constexpr float SUBNORMAL_UNIT = std::bit_cast<float>(uint32_t(128 - BIAS - MANTISSA) << 23);
  static inline float load(uint8_t v) {
    const uint32_t mag = v & 0x7fu;
    const float normal = std::bit_cast<float>((mag << (23 - MANTISSA)) + EXPONENT_SHIFT);
    float f = (mag >> MANTISSA) == 0 ? float(mag) * SUBNORMAL_UNIT : normal;
    if constexpr (MANTISSA == 3)  // e4m3fn: no infinities, NaN = all ones
      f = mag == 0x7fu ? __builtin_nanf("") : f;
    else  // e5m2: exponent all ones = infinity (mantissa 0) or NaN
      f = mag >= 0x7cu ? (mag == 0x7cu ? __builtin_inff() : __builtin_nanf("")) : f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | (uint32_t(v & 0x80u) << 24));
  }
};
using FP8E4M3 = FP8<3, 7>;
using FP8E5M2 = FP8<2, 15>;

inline bool is_fp8(const Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

template <class Fn>
void dispatch_fp8(const Tensor& t, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat8_e4m3fn: fn(FP8E4M3{}); break;
    case at::kFloat8_e5m2: fn(FP8E5M2{}); break;
    default: TORCH_CHECK(false, "expected float8_e4m3fn or float8_e5m2, not ", t.scalar_type());
  }
}

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

// exp(x) for x <= 88 (Cephes' polynomial, ~1 ulp): plain arithmetic that the compiler
// vectorises, unlike a call to expf.
__attribute__((always_inline)) inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

template <class D>
typename D::T* ptr(const Tensor& t) {
  return static_cast<typename D::T*>(t.data_ptr());
}

}  // namespace splitserve
