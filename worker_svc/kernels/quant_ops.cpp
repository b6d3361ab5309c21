// Quantized linear layers on the CPU, registered as torch.ops.splitserve.*:
//   quant_linear        y = x W^T (+ b) with W int8 ("pairs") or int4 in the tile layout (quant_tiles.h),
//                       group-wise scales and optional offsets (w = scale * q + offset); the
//                       activations stay float (W8A16 / W4A16); bf16 steps of many tokens
//                       run against bf16 panels converted once per step (run_panels)
//   quant_dequantize    W^T in float (quant_dequant.h; steps of many tokens hand it to oneDNN's
//                       matmul)
//   quant_isa           which instruction-set paths this build has
// (W8A8's w8a8_linear and int8_quantize_rows: w8a8_ops.cpp; the argument checks: quant_args.h.)
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
#include "quant_args.h"
#include "quant_dequant.h"
#include "quant_tiles.h"

namespace {

using at::Tensor;
using namespace splitserve;
using namespace splitserve::quant;

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
  m.def("quant_dequantize(Tensor(a!) out, Tensor qweight, int bits, Tensor scales, Tensor? offsets, Tensor bounds) -> ()");
  m.def("quant_isa() -> str", &quant_isa);
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
}
