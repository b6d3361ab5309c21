// What the quantized linear ops (quant_ops.cpp, w8a8_ops.cpp) share: the checks of their
// arguments (a packed weight in quant_tiles.h's layout, and its input and output), the packed
// column -> input feature map, and the blocks of tokens their tile kernels take at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "quant_tiles.h"

namespace splitserve::quant {

using OptTensor = std::optional<at::Tensor>;
using at::Tensor;

constexpr int64_t MAX_MB = 8;

struct Packed {
  int64_t bits, num_tiles, num_chunks, num_groups;
  bool is_half_scales;
};

inline Packed check_packed(const Tensor& qweight, int64_t bits, const Tensor& scales,
                           const OptTensor& offsets, const Tensor& bounds) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  const int64_t chunk = bits == 8 ? 64 : 32;
  TORCH_CHECK(qweight.device().is_cpu() && qweight.is_contiguous() && qweight.dim() == 3 &&
                  qweight.size(2) == chunk && qweight.element_size() == 1,
              "qweight must be contiguous 8-bit [tiles, chunks, ", chunk, "] on the CPU");
  const int64_t tiles = qweight.size(0), chunks = qweight.size(1);
  TORCH_CHECK(bounds.scalar_type() == at::kInt && bounds.is_contiguous() && bounds.dim() == 1 &&
                  bounds.numel() >= 2, "bounds must be int32 [groups + 1]");
  const int64_t groups = bounds.numel() - 1;
  const int32_t* b = bounds.data_ptr<int32_t>();
  TORCH_CHECK(b[0] == 0 && b[groups] == chunks, "bounds must run from 0 to ", chunks, " chunks");
  for (int64_t g = 0; g < groups; ++g) TORCH_CHECK(b[g] <= b[g + 1], "bounds must not decrease");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scales.scalar_type() == at::kFloat, "scales must be float32 or float16");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == tiles &&
                  scales.size(1) == groups && scales.size(2) == TILE,
              "scales must be contiguous [", tiles, ", ", groups, ", 16]");
  if (offsets)
    TORCH_CHECK(offsets->scalar_type() == scales.scalar_type() && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(), "offsets must be shaped and typed as scales");
  return {bits, tiles, chunks, groups, half};
}

inline void check_io(const Tensor& out, const Tensor& x, int64_t num_tiles, const OptTensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be [tokens, in_features] with contiguous rows on the CPU");
  const int64_t n = out.dim() == 2 ? out.size(1) : -1;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.scalar_type() == x.scalar_type(),
              "out must be contiguous [tokens, out_features] of x's dtype");
  TORCH_CHECK(n > (num_tiles - 1) * TILE && n <= num_tiles * TILE, "out has ", n,
              " features but the weight has ", num_tiles, " tiles of 16 rows");
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "bias must hold out_features values of x's dtype");
}

// The packed column -> input feature map (K: a zero column).
inline std::vector<int64_t> column_map(const OptTensor& cols, int64_t num_cols, int64_t k) {
  std::vector<int64_t> map(num_cols);
  if (cols) {
    TORCH_CHECK(cols->scalar_type() == at::kLong && cols->is_contiguous() && cols->numel() == num_cols,
                "cols must be int64 [", num_cols, "] (one input feature per packed column)");
    const int64_t* c = cols->data_ptr<int64_t>();
    for (int64_t i = 0; i < num_cols; ++i) {
      TORCH_CHECK(c[i] >= 0 && c[i] <= k, "cols[", i, "] = ", c[i], " is outside [0, ", k, "]");
      map[i] = c[i];
    }
  } else {
    TORCH_CHECK(k <= num_cols, "x has ", k, " features but the weight only ", num_cols, " columns");
    for (int64_t i = 0; i < num_cols; ++i) map[i] = std::min(i, k);
  }
  return map;
}

// Blocks of tokens (first, count): 8 at a time, the rest in 4, 2, 1.
inline std::vector<std::pair<int64_t, int64_t>> token_blocks(int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t m0 = 0; m0 < rows;) {
    const int64_t left = rows - m0;
    const int64_t mb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    blocks.emplace_back(m0, mb);
    m0 += mb;
  }
  return blocks;
}

}  // namespace splitserve::quant
