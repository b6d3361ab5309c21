// Quantized linear layers on the CPU, registered as torch.ops.splitserve.*:
//   quant_linear        y = x W^T (+ b) with W int8 ("pairs") or int4 in the tile layout (quant_tiles.h),
//                       group-wise scales and optional offsets (w = scale * q + offset); the
//                       activations stay float (W8A16 / W4A16); bf16 steps of many tokens
//                       run against bf16 panels converted once per step (run_panels)
//   w8a8_linear         y = x W^T (+ b) with x quantized per token to int8 on the fly and W int8
//                       ("quads") with one scale per output row (W8A8)
//   int8_quantize_rows  that per-token quantization alone: vLLM's convention (its CPU and CUDA
//                       kernels): scale = absmax / 127, q = round-half-even(x * (1 / scale))
//                       clamped to [-128, 127], 1 / scale taken in double as vLLM-CPU does
//   quant_dequantize    W^T in float (quant_dequant.h; steps of many tokens hand it to oneDNN's
//                       matmul)
//   quant_isa           which instruction-set paths this build has
// The activations are first gathered into a scratch row per token: in the packed column order
// (`cols`: input feature of each packed column, K meaning zero: padding, act-order), as float32
// (or bf16 pairs for the int4 x bf16 kernel), with each group's sum. Tiles of 16 output rows
// (times blocks of up to 8 tokens) are shared out over the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "quant_dequant.h"
#include "quant_tiles.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using namespace splitserve;
using namespace splitserve::quant;

constexpr int64_t MAX_MB = 8;

struct Packed {
  int64_t bits, num_tiles, num_chunks, num_groups;
  bool is_half_scales;
};

Packed check_packed(const Tensor& qweight, int64_t bits, const Tensor& scales,
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

void check_io(const Tensor& out, const Tensor& x, int64_t num_tiles, const OptTensor& bias) {
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
std::vector<int64_t> column_map(const OptTensor& cols, int64_t num_cols, int64_t k) {
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

// x gathered per token (float32, or bf16 bits when `as_bf16`), and each group's sum.
struct Activations {
  std::vector<float> xf;
  std::vector<uint16_t> xb;
  std::vector<float> xs;
  int64_t stride;
};

// One token's row in packed column order: contiguous (a cheap vectorised copy) unless the
// weight permutes or pads its columns inside.
template <class D, class T, class Store>
void gather_row(const typename D::T* xr, int64_t k, const std::vector<int64_t>& map,
                bool is_identity, T* out, Store store) {
  const int64_t width = int64_t(map.size());
  if (is_identity) {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) out[i] = store(D::load(xr[i]));
    for (int64_t i = k; i < width; ++i) out[i] = store(0.0f);
    return;
  }
  for (int64_t i = 0; i < width; ++i) out[i] = store(map[i] < k ? D::load(xr[map[i]]) : 0.0f);
}

template <class D>
Activations gather(const Tensor& x, const std::vector<int64_t>& map, const int32_t* bounds,
                   int64_t groups, bool as_bf16, bool with_sums) {
  const int64_t rows = x.size(0), k = x.size(1), width = int64_t(map.size());
  bool is_identity = true;
  for (int64_t i = 0; i < width && is_identity; ++i) is_identity = map[i] == std::min(i, k);
  Activations a{{}, {}, {}, width};
  (as_bf16 ? a.xb.resize(rows * width) : a.xf.resize(rows * width));
  if (with_sums) a.xs.resize(rows * groups);
  const auto* xs = ptr<D>(x);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = xs + r * x.stride(0);
      if (as_bf16)
        gather_row<D>(xr, k, map, is_identity, a.xb.data() + r * width, BF16::store);
      else
        gather_row<D>(xr, k, map, is_identity, a.xf.data() + r * width, [](float v) { return v; });
      for (int64_t g = 0; with_sums && g < groups; ++g) {
        float sum = 0.0f;
        if (as_bf16) {
          const uint16_t* row = a.xb.data() + r * width;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 4 * bounds[g]; i < 4 * bounds[g + 1]; ++i) sum += BF16::load(row[i]);
        } else {
          const float* row = a.xf.data() + r * width;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 4 * bounds[g]; i < 4 * bounds[g + 1]; ++i) sum += row[i];
        }
        a.xs[r * groups + g] = sum;
      }
    }
  });
  return a;
}

using TileFn = void (*)(const TileArgs&, float (*)[TILE]);

template <int BITS, class S>
void generic_fn(const TileArgs& a, int64_t mb, float (*out)[TILE]) { tile_generic<BITS, S>(a, mb, out); }

enum class Kind { Int8F32, Int4F32, Int8Bf16, Int4Bf16 };

// The AVX-512 kernel for NT tiles x MB tokens (nullptr: none in this build).
template <int NT, int MB, class S>
TileFn kernel_for(Kind kind) {
#ifdef SPLITSERVE_QUANT_AVX512
#ifdef SPLITSERVE_QUANT_BF16
  if (kind == Kind::Int4Bf16) return tile_int4_bf16<NT, MB, S>;
  if (kind == Kind::Int8Bf16) return tile_int8_bf16<NT, MB, S>;
#endif
  if (kind == Kind::Int4F32) return tile_int4_f32<NT, MB, S>;
  if constexpr (NT == 1) return tile_int8_f32<1, MB, S>;
#endif
  return nullptr;
}

template <int NT, class S>
TileFn kernel_for_block(Kind kind, int64_t mb) {
  switch (mb) {
    case 8: return kernel_for<NT, 8, S>(kind);
    case 4: return kernel_for<NT, 4, S>(kind);
    case 2: return kernel_for<NT, 2, S>(kind);
    default: return kernel_for<NT, 1, S>(kind);
  }
}

// Which kernel a call takes: bf16 activations on AVX512_BF16 use the bf16 dot products.
Kind kernel_kind(int64_t bits, const Tensor& x) {
#ifdef SPLITSERVE_QUANT_BF16
  if (x.scalar_type() == at::kBFloat16) return bits == 4 ? Kind::Int4Bf16 : Kind::Int8Bf16;
#endif
  return bits == 4 ? Kind::Int4F32 : Kind::Int8F32;
}

// Tiles a kernel call takes at once (two share each activation broadcast).
int64_t tiles_per_call(Kind kind) {
#ifdef SPLITSERVE_QUANT_AVX512
  return kind == Kind::Int8F32 ? 1 : 2;
#else
  return 1;
#endif
}

// Blocks of tokens (first, count): 8 at a time, the rest in 4, 2, 1.
std::vector<std::pair<int64_t, int64_t>> token_blocks(int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t m0 = 0; m0 < rows;) {
    const int64_t left = rows - m0;
    const int64_t mb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    blocks.emplace_back(m0, mb);
    m0 += mb;
  }
  return blocks;
}

// tot[t * mb + m] (+ bias) into out rows m0 .. m0 + mb, columns of tiles t0 .. t0 + nt.
template <class D>
void store_block(typename D::T* o, const typename D::T* b, int64_t n, int64_t t0, int64_t nt,
                 int64_t m0, int64_t mb, const float (*tot)[TILE]) {
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t m = 0; m < mb; ++m) {
      const int64_t first = (t0 + t) * TILE, width = std::min(TILE, n - first);
      const float* row = tot[t * mb + m];
      auto* orow = o + (m0 + m) * n + first;
      for (int64_t i = 0; i < width; ++i)
        orow[i] = D::store(row[i] + (b ? D::load(b[first + i]) : 0.0f));
    }
}

template <class D, class S>
void run_tiles(const Tensor& out, const Tensor& x, const Tensor& qweight, const Packed& p,
               const Tensor& scales, const OptTensor& offsets, const int32_t* bounds,
               const std::vector<int64_t>& map, const OptTensor& bias) {
  const Kind kind = kernel_kind(p.bits, x);
  const bool bf16 = kind == Kind::Int4Bf16 || kind == Kind::Int8Bf16;
  const Activations act =
      gather<D>(x, map, bounds, p.num_groups, bf16, kind == Kind::Int4Bf16 || offsets.has_value());
  const int64_t n = out.size(1), per_call = tiles_per_call(kind);
  const auto blocks = token_blocks(x.size(0));
  const int64_t num_blocks = int64_t(blocks.size()), calls = (p.num_tiles + per_call - 1) / per_call;
  const int64_t tile_bytes = p.num_chunks * (p.bits == 8 ? 64 : 32);
  const int64_t scale_stride = p.num_groups * TILE, scale_size = p.is_half_scales ? 2 : 4;
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const auto* sc = static_cast<const uint8_t*>(scales.data_ptr());
  const auto* of = offsets ? static_cast<const uint8_t*>(offsets->data_ptr()) : nullptr;
  const auto* b = bias ? ptr<D>(*bias) : nullptr;
  auto* o = ptr<D>(out);
  at::parallel_for(0, calls * num_blocks, 1, [&](int64_t begin, int64_t end) {
    float tot[2 * MAX_MB][TILE];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t0 = task / num_blocks * per_call, nt = std::min(per_call, p.num_tiles - t0);
      const auto [m0, mb] = blocks[task % num_blocks];
      const void* xp = bf16 ? static_cast<const void*>(act.xb.data() + m0 * act.stride)
                            : static_cast<const void*>(act.xf.data() + m0 * act.stride);
      const int64_t scale_offset = t0 * scale_stride * scale_size;
      const TileArgs args{w + t0 * tile_bytes, tile_bytes, sc + scale_offset,
                          of ? of + scale_offset : nullptr, scale_stride, bounds, p.num_groups,
                          xp, bf16 ? act.stride / 2 : act.stride,
                          act.xs.empty() ? nullptr : act.xs.data() + m0 * p.num_groups};
      const TileFn fn = nt == 2 ? kernel_for_block<2, S>(kind, mb) : kernel_for_block<1, S>(kind, mb);
      if (fn)
        fn(args, tot);
      else
        (p.bits == 8 ? generic_fn<8, S> : generic_fn<4, S>)(args, mb, tot);
      store_block<D>(o, b, n, t0, nt, m0, mb, tot);
    }
  });
}

#ifdef SPLITSERVE_QUANT_BF16
// From PANEL_ROWS bf16 tokens (int8; int4 from SCALED_ROWS: its per-block kernel converts
// cheaply, and its many groups cost a panel more) a step converts each pair of tiles once into
// a cache-resident panel of bf16 pairs (quant_dequant.h) and runs every token block against
// it, instead of converting the weight again for each block of 8 tokens; from SCALED_ROWS (the
// Python side's DEQUANTIZE_ROWS: the numbers of a matmul on the weight dequantized to bf16) the
// panel holds the weight rounded to bf16, below it the integers (exact, scaled after the sums).
constexpr int64_t PANEL_ROWS = 32, SCALED_ROWS = 128, PANEL_TILES = 2;

template <int NT, class S>
void panel_block(const uint32_t* panel, int64_t pairs, const TileArgs& a, bool is_scaled,
                 int64_t mb, float (*out)[TILE]) {
  switch (mb) {
    case 8: return panel_tokens<NT, 8, S>(panel, pairs, a, is_scaled, out);
    case 4: return panel_tokens<NT, 4, S>(panel, pairs, a, is_scaled, out);
    case 2: return panel_tokens<NT, 2, S>(panel, pairs, a, is_scaled, out);
    default: return panel_tokens<NT, 1, S>(panel, pairs, a, is_scaled, out);
  }
}

template <class S>
void run_panels(const Tensor& out, const Tensor& x, const Tensor& qweight, const Packed& p,
                const Tensor& scales, const OptTensor& offsets, const int32_t* bounds,
                const std::vector<int64_t>& map, const OptTensor& bias) {
  const bool is_scaled = x.size(0) >= SCALED_ROWS;
  const Activations act = gather<BF16>(x, map, bounds, p.num_groups, true, offsets && !is_scaled);
  const int64_t n = out.size(1), pairs = p.num_chunks * 2, x_stride = act.stride / 2;
  const int64_t tile_bytes = p.num_chunks * (p.bits == 8 ? 64 : 32), scale_stride = p.num_groups * TILE;
  const int64_t calls = (p.num_tiles + PANEL_TILES - 1) / PANEL_TILES;
  const auto blocks = token_blocks(x.size(0));
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const S* sc = scales.data_ptr<S>();
  const S* of = offsets ? offsets->data_ptr<S>() : nullptr;
  const auto* b = bias ? ptr<BF16>(*bias) : nullptr;
  auto* o = ptr<BF16>(out);
  at::parallel_for(0, calls, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> panel(PANEL_TILES * pairs * TILE);
    float tot[2 * MAX_MB][TILE];
    for (int64_t call = begin; call < end; ++call) {
      const int64_t t0 = call * PANEL_TILES, nt = std::min(PANEL_TILES, p.num_tiles - t0);
      TileArgs args{w + t0 * tile_bytes, tile_bytes, sc + t0 * scale_stride,
                    of ? of + t0 * scale_stride : nullptr, scale_stride, bounds, p.num_groups,
                    nullptr, x_stride, nullptr};
      (p.bits == 8 ? panel_weights<8, S> : panel_weights<4, S>)(args, nt, p.num_chunks, is_scaled,
                                                                panel.data());
      for (const auto& [m0, mb] : blocks) {
        args.x = act.xb.data() + m0 * act.stride;
        args.xs = act.xs.empty() ? nullptr : act.xs.data() + m0 * p.num_groups;
        (nt == 2 ? panel_block<2, S> : panel_block<1, S>)(panel.data(), pairs, args, is_scaled, mb, tot);
        store_block<BF16>(o, b, n, t0, nt, m0, mb, tot);
      }
    }
  });
}
#endif

void quant_linear(Tensor out, Tensor x, Tensor qweight, int64_t bits, Tensor scales,
                  OptTensor offsets, Tensor bounds, OptTensor cols, OptTensor bias) {
  const Packed p = check_packed(qweight, bits, scales, offsets, bounds);
  check_io(out, x, p.num_tiles, bias);
  const std::vector<int64_t> map = column_map(cols, p.num_chunks * 4, x.size(1));
  if (x.size(0) == 0) return;
  const int32_t* b = bounds.data_ptr<int32_t>();
#ifdef SPLITSERVE_QUANT_BF16
  const int64_t panel_rows = bits == 8 ? PANEL_ROWS : SCALED_ROWS;
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= panel_rows) {
    if (p.is_half_scales)
      run_panels<c10::Half>(out, x, qweight, p, scales, offsets, b, map, bias);
    else
      run_panels<float>(out, x, qweight, p, scales, offsets, b, map, bias);
    return;
  }
#endif
  dispatch(x, [&](auto tag) {
    using D = decltype(tag);
    if (p.is_half_scales)
      run_tiles<D, c10::Half>(out, x, qweight, p, scales, offsets, b, map, bias);
    else
      run_tiles<D, float>(out, x, qweight, p, scales, offsets, b, map, bias);
  });
}

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

// Blocks of tiles shared out over the threads, each writing its columns of W^T (quant_dequant.h).
constexpr int64_t DEQUANTIZE_TILES = 8;

template <class D, class S>
void dequantize_weight(const Tensor& out, const uint8_t* w, const Packed& p, const S* sc,
                       const S* of, const int32_t* bounds) {
  auto* o = ptr<D>(out);
  const int64_t ld = p.num_tiles * TILE, tile_bytes = p.num_chunks * (p.bits == 8 ? 64 : 32);
  const int64_t scale_stride = p.num_groups * TILE;
  const int64_t num_blocks = (p.num_tiles + DEQUANTIZE_TILES - 1) / DEQUANTIZE_TILES;
  at::parallel_for(0, num_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t = b0 * DEQUANTIZE_TILES; t < std::min(b1 * DEQUANTIZE_TILES, p.num_tiles);
         t += DEQUANTIZE_TILES)
      dequantize_tiles<D, S>(w + t * tile_bytes, p.bits, tile_bytes, sc + t * scale_stride,
                             of ? of + t * scale_stride : nullptr, scale_stride, bounds,
                             p.num_groups, std::min(DEQUANTIZE_TILES, p.num_tiles - t),
                             o + t * TILE, ld);
  });
}

void quant_dequantize(Tensor out, Tensor qweight, int64_t bits, Tensor scales, OptTensor offsets,
                      Tensor bounds) {
  const Packed p = check_packed(qweight, bits, scales, offsets, bounds);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == p.num_chunks * 4 &&
                  out.size(1) == p.num_tiles * TILE,
              "out must be contiguous [chunks * 4, tiles * 16] (the weight transposed)");
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  const int32_t* b = bounds.data_ptr<int32_t>();
  dispatch(out, [&](auto tag) {
    using D = decltype(tag);
    if (p.is_half_scales)
      dequantize_weight<D, c10::Half>(out, w, p, scales.data_ptr<c10::Half>(),
                                      offsets ? offsets->data_ptr<c10::Half>() : nullptr, b);
    else
      dequantize_weight<D, float>(out, w, p, scales.data_ptr<float>(),
                                  offsets ? offsets->data_ptr<float>() : nullptr, b);
  });
}

std::string quant_isa() {
  std::string paths = "portable";
#ifdef SPLITSERVE_QUANT_AVX512
  paths += ",avx512";
#endif
#ifdef SPLITSERVE_QUANT_BF16
  paths += ",avx512_bf16";
#endif
#ifdef SPLITSERVE_QUANT_VNNI
  paths += ",avx512_vnni";
#endif
  return paths;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor qweight, int bits, Tensor scales, Tensor? offsets, Tensor bounds, Tensor? cols, Tensor? bias) -> ()");
  m.def("w8a8_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor weight_scales, Tensor weight_sums, Tensor? bias) -> ()");
  m.def("int8_quantize_rows(Tensor(a!) out, Tensor(b!) scales, Tensor x) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor qweight, int bits, Tensor scales, Tensor? offsets, Tensor bounds) -> ()");
  m.def("quant_isa() -> str", &quant_isa);
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("w8a8_linear", w8a8_linear);
  m.impl("int8_quantize_rows", int8_quantize_rows);
  m.impl("quant_dequantize", quant_dequantize);
}
