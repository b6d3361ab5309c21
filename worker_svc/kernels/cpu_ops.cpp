// splitserve's CPU kernels, registered as torch.ops.splitserve.*:
//   rms_norm, fused_add_rms_norm  RMSNorm (after the residual add) in one pass over each row
//   silu_and_mul                  silu(gate) * up of the fused gate_up projection
//   rotary_neox_                  neox rotary embedding of q and k heads, in place
//   lora_add_                     LoRA adapters of the rows' slots added to a linear layer's
//                                 output, every slot of a step in one call
// The elementwise kernels compute in float32 and round where the torch path (worker_svc.layers)
// rounds, so their bf16 results match it (bit for bit in the tests). The paged decode attention
// is in attention_ops.cpp.
// Small inputs run on one thread (torch's own grain: 32768 values). Built on the worker's
// machine by worker_svc/kernels/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_common.h"

namespace {

using at::Tensor;
using splitserve::BF16;
using splitserve::dispatch;
using splitserve::fast_exp;
using splitserve::F16;
using splitserve::F32;
using splitserve::ptr;

void check_rows(const Tensor& t, int64_t width, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, name,
              " must be [rows, ", width, "] with contiguous rows");
}

constexpr int64_t GRAIN = 32768;

int64_t rows_grain(int64_t width) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(width, 1)); }

// out = norm(x) * weight, or with `residual`: residual += x, out = norm(residual) * weight.
void rms_norm_impl(const Tensor& out, const Tensor* residual, const Tensor& x, const Tensor& weight,
                   double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  check_rows(x, width, "x");
  check_rows(out, width, "out");
  if (residual) check_rows(*residual, width, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == width, "weight must hold ", width, " values");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  (!residual || residual->scalar_type() == x.scalar_type()),
              "rms_norm: every tensor must have one dtype");
  dispatch(x, [&](auto tag) {
    using D = decltype(tag);
    using T = typename D::T;
    const T* xs = ptr<D>(x);
    const T* w = ptr<D>(weight);
    T* os = ptr<D>(out);
    T* rs = residual ? ptr<D>(*residual) : nullptr;
    const int64_t xst = x.stride(0), ost = out.stride(0), rst = residual ? residual->stride(0) : 0;
    const bool is_f32 = std::is_same<D, F32>::value;
    at::parallel_for(0, rows, rows_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xs + r * xst;
        T* orow = os + r * ost;
        const T* src = xr;
        if (rs) {
          T* rr = rs + r * rst;
#pragma omp simd
          for (int64_t i = 0; i < width; ++i) rr[i] = D::store(D::load(rr[i]) + D::load(xr[i]));
          src = rr;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; ++i) {
          float v = D::load(src[i]);
          sum += v * v;
        }
        const float inv = 1.0f / std::sqrt(sum / float(width) + float(eps));
        if (is_f32) {
#pragma omp simd
          for (int64_t i = 0; i < width; ++i) orow[i] = D::store(D::load(src[i]) * inv * D::load(w[i]));
        } else {  // transformers' order: normalise in float, round, scale in the dtype
#pragma omp simd
          for (int64_t i = 0; i < width; ++i)
            orow[i] = D::store(D::load(D::store(D::load(src[i]) * inv)) * D::load(w[i]));
        }
      }
    });
  });
}

void rms_norm(Tensor out, Tensor x, Tensor weight, double eps) {
  rms_norm_impl(out, nullptr, x, weight, eps);
}

void fused_add_rms_norm(Tensor out, Tensor residual, Tensor x, Tensor weight, double eps) {
  TORCH_CHECK(residual.size(0) == x.size(0), "residual and x must have the same rows");
  rms_norm_impl(out, &residual, x, weight, eps);
}

template <class D>
void silu_mul_row(const typename D::T* __restrict g, typename D::T* __restrict o, int64_t d) {
  const typename D::T* __restrict u = g + d;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float x = D::load(g[i]);
    const float s = D::load(D::store(x / (1.0f + fast_exp(-x))));
    o[i] = D::store(s * D::load(u[i]));
  }
}

// out [rows, d] = silu(gate_up[:, :d]) * gate_up[:, d:], the silu rounded to the dtype first.
void silu_and_mul(Tensor out, Tensor gate_up) {
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  check_rows(gate_up, 2 * d, "gate_up");
  check_rows(out, d, "out");
  TORCH_CHECK(out.size(0) == rows && out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: out must be [rows, d] of gate_up's dtype");
  dispatch(gate_up, [&](auto tag) {
    using D = decltype(tag);
    using T = typename D::T;
    const T* in = ptr<D>(gate_up);
    T* os = ptr<D>(out);
    const int64_t ist = gate_up.stride(0), ost = out.stride(0);
    at::parallel_for(0, rows, rows_grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row<D>(in + r * ist, os + r * ost, d);
    });
  });
}

// Rotates the first `rotary_dim` values of every head of x [tokens, heads, head_dim] in place
// (neox: the two halves rotate together) by the cos/sin [max_positions, rotary_dim / 2] rows of
// each token's position.
void rotary_neox_(Tensor x, Tensor positions, Tensor cos_cache, Tensor sin_cache, int64_t rotary_dim) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), half = rotary_dim / 2;
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= x.size(2), "bad rotary_dim ", rotary_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == tokens, "positions must be int64 [tokens]");
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.dim() == 2 &&
                  cos_cache.size(1) == half && sin_cache.sizes() == cos_cache.sizes() &&
                  cos_cache.scalar_type() == x.scalar_type() &&
                  sin_cache.scalar_type() == x.scalar_type(),
              "cos/sin caches must be [max_positions, rotary_dim / 2] of x's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside [0, ", max_pos, ")");
  dispatch(x, [&](auto tag) {
    using D = decltype(tag);
    using T = typename D::T;
    T* xs = ptr<D>(x);
    const T* cs = ptr<D>(cos_cache);
    const T* ss = ptr<D>(sin_cache);
    const int64_t tst = x.stride(0), hst = x.stride(1);
    at::parallel_for(0, tokens, rows_grain(heads * rotary_dim),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cs + pos[t] * half;
        const T* s = ss + pos[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
          T* a = xs + t * tst + h * hst;
          T* b = a + half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = D::load(a[i]), x2 = D::load(b[i]);
            const float ci = D::load(c[i]), si = D::load(s[i]);
            a[i] = D::store(D::load(D::store(x1 * ci)) - x2 * si);
            b[i] = D::store(D::load(D::store(x2 * ci)) + x1 * si);
          }
        }
      }
    });
  });
}

// LoRA over the runs of rows that share an adapter slot (rows grouped by slot):
//   y[a:b] += (x[a:b] @ A_s^T) @ B_s   for each run (slot s, rows a..b) in `runs` [n, 3]
// A [slots, R, in] (each rank row contiguous) and B [slots, R, out], R = parts * rank: rank
// row k of part p (k < slot_ranks[s]) only reaches the columns [col_offsets[p],
// col_offsets[p + 1]) of a fused layer (its B is block-diagonal; the zeros are never read).
// Products and sums in float32, one rounding into y. The threads share the blocks of up to
// LORA_ROWS rows of every run; a block's shrink (one pass over its adapter's A) and expand
// (one pass over B, LORA_COLS columns at a time) need no other block, so a call is one
// parallel region without a barrier (a decode step: one block per adapter).
constexpr int64_t LORA_COLS = 256;
constexpr int64_t LORA_ROWS = 32;

struct LoraBlock {
  int64_t slot, start, end;
};

template <class D>
void lora_shrink(const Tensor& x, const typename D::T* arows, const LoraBlock& b, int64_t width,
                 int64_t rank, int64_t slot_rank, float* h) {
  using T = typename D::T;
  const int64_t in = x.size(1), xst = x.stride(0);
  const T* xs = ptr<D>(x);
  for (int64_t k = 0; k < width; ++k) {
    if (k % rank >= slot_rank) continue;
    const T* arow = arows + k * in;
    for (int64_t row = b.start; row < b.end; ++row) {
      const T* xr = xs + row * xst;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += D::load(xr[i]) * D::load(arow[i]);
      h[(row - b.start) * width + k] = sum;
    }
  }
}

template <class D>
void lora_expand(const Tensor& y, const typename D::T* brows, const LoraBlock& b, int64_t width,
                 int64_t rank, int64_t slot_rank, const std::vector<int64_t>& cols,
                 const float* h) {
  using T = typename D::T;
  const int64_t out = y.size(1), yst = y.stride(0), rows = b.end - b.start;
  T* ys = ptr<D>(y);
  float acc[LORA_ROWS][LORA_COLS];
  for (int64_t c0 = 0; c0 < out; c0 += LORA_COLS) {
    const int64_t c1 = std::min(out, c0 + LORA_COLS);
    for (int64_t i = 0; i < rows; ++i) std::fill(acc[i], acc[i] + LORA_COLS, 0.0f);
    for (int64_t p = 0; p + 1 < int64_t(cols.size()); ++p) {  // parts meeting the chunk
      const int64_t p0 = std::max(c0, cols[p]), p1 = std::min(c1, cols[p + 1]);
      for (int64_t k = p * rank; p0 < p1 && k < p * rank + slot_rank; ++k) {
        const T* brow = brows + k * out;
        for (int64_t i = 0; i < rows; ++i) {
          const float hv = h[i * width + k];
          float* ai = acc[i];
#pragma omp simd
          for (int64_t c = p0; c < p1; ++c) ai[c - c0] += hv * D::load(brow[c]);
        }
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      T* yr = ys + (b.start + i) * yst;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) yr[c] = D::store(D::load(yr[c]) + acc[i][c - c0]);
    }
  }
}

template <class D>
void lora_blocks(const Tensor& y, const Tensor& x, const Tensor& a, const Tensor& b,
                 const std::vector<LoraBlock>& blocks, const std::vector<int64_t>& cols,
                 const int64_t* ranks) {
  using T = typename D::T;
  const int64_t width = a.size(1), in = a.size(2), out = b.size(2);
  const int64_t rank = width / (int64_t(cols.size()) - 1);
  const T* as = ptr<D>(a);
  const T* bs = ptr<D>(b);
  at::parallel_for(0, int64_t(blocks.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> h(LORA_ROWS * width);  // written before it is read
    for (int64_t i = lo; i < hi; ++i) {
      const LoraBlock& block = blocks[i];
      const int64_t slot_rank = ranks[block.slot];
      lora_shrink<D>(x, as + block.slot * width * in, block, width, rank, slot_rank, h.data());
      lora_expand<D>(y, bs + block.slot * width * out, block, width, rank, slot_rank, cols,
                     h.data());
    }
  });
}

void lora_add_(Tensor y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor runs, Tensor col_offsets,
               Tensor slot_ranks) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  check_rows(x, in, "x");
  check_rows(y, out, "y");
  TORCH_CHECK(y.size(0) == rows && y.scalar_type() == x.scalar_type(), "y must be [rows, out] of x's dtype");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous() && lora_a.dim() == 3 &&
                  lora_b.dim() == 3 && lora_a.size(2) == in && lora_b.size(2) == out &&
                  lora_a.size(0) == lora_b.size(0) && lora_a.size(1) == lora_b.size(1) &&
                  lora_a.scalar_type() == x.scalar_type() && lora_b.scalar_type() == x.scalar_type(),
              "lora_a must be [slots, R, in] and lora_b [slots, R, out], contiguous, of x's dtype");
  const int64_t slots = lora_a.size(0), width = lora_a.size(1), parts = col_offsets.numel() - 1;
  TORCH_CHECK(col_offsets.scalar_type() == at::kLong && col_offsets.is_contiguous() && parts >= 1 &&
                  width % parts == 0, "col_offsets must be int64 [parts + 1], R a multiple of parts");
  TORCH_CHECK(slot_ranks.scalar_type() == at::kLong && slot_ranks.is_contiguous() &&
                  slot_ranks.numel() == slots, "slot_ranks must be int64 [slots]");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && runs.dim() == 2 &&
                  runs.size(1) == 3, "runs must be int64 [n, 3]: slot, first row, end row");
  const int64_t rank = width / parts;
  const int64_t* ranks = slot_ranks.data_ptr<int64_t>();
  std::vector<int64_t> cols(col_offsets.data_ptr<int64_t>(), col_offsets.data_ptr<int64_t>() + parts + 1);
  std::vector<int64_t> run(runs.data_ptr<int64_t>(), runs.data_ptr<int64_t>() + runs.numel());
  TORCH_CHECK(cols.front() == 0 && cols.back() == out, "col_offsets must run from 0 to out");
  for (size_t p = 0; p + 1 < cols.size(); ++p) TORCH_CHECK(cols[p] <= cols[p + 1], "col_offsets must grow");
  for (int64_t s = 0; s < slots; ++s) TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= rank, "bad slot rank");
  for (size_t r = 0; r < run.size(); r += 3)
    TORCH_CHECK(run[r] >= 0 && run[r] < slots && 0 <= run[r + 1] && run[r + 1] <= run[r + 2] &&
                    run[r + 2] <= rows, "a run's slot or rows are out of range");
  std::vector<LoraBlock> blocks;
  for (size_t r = 0; r < run.size(); r += 3)
    for (int64_t row = run[r + 1]; row < run[r + 2]; row += LORA_ROWS)
      if (ranks[run[r]] > 0) blocks.push_back({run[r], row, std::min(run[r + 2], row + LORA_ROWS)});
  dispatch(x, [&](auto tag) { lora_blocks<decltype(tag)>(y, x, lora_a, lora_b, blocks, cols, ranks); });
}

}  // namespace

TORCH_LIBRARY(splitserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary_neox_(Tensor(a!) x, Tensor positions, Tensor cos_cache, Tensor sin_cache, int rotary_dim) -> ()");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor runs, Tensor col_offsets, Tensor slot_ranks) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_neox_", rotary_neox_);
  m.impl("lora_add_", lora_add_);
}
