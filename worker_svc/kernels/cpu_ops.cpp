// splitserve's CPU kernels, registered as torch.ops.splitserve.*:
//   rms_norm, fused_add_rms_norm  RMSNorm (after the residual add) in one pass over each row
//   silu_and_mul                  silu(gate) * up of the fused gate_up projection
//   rotary_neox_                  neox rotary embedding of q and k heads, in place
//   paged_decode_attention        one query token per request over its paged KV cache, read
//                                 in place through the block table (no gather copy)
//   lora_add_                     LoRA adapters of the rows' slots added to a linear layer's
//                                 output, every slot of a step in one call
// The elementwise kernels compute in float32 and round where the torch path (worker_svc.layers)
// rounds, so their bf16 results match it (bit for bit in the tests). The decode attention keeps scores and
// sums in float32; in bf16 on AVX512-BF16 machines it takes the bf16 dot-product instructions,
// with the probabilities rounded to bf16 as the matmul path (worker_svc.attention) has them.
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SPLITSERVE_AVX512_BF16 1  // bf16 decodes take the dot-product instructions
#endif

namespace {

using at::Tensor;
using splitserve::BF16;
using splitserve::dispatch;
using splitserve::F16;
using splitserve::F32;
using splitserve::ptr;

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

// scores[t] = exp(scores[t] - max) in place; returns 1 / their sum (the softmax's scale).
float exp_shifted(float* scores, int64_t num) {
  float m = scores[0];
  for (int64_t t = 1; t < num; ++t) m = std::max(m, scores[t]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < num; ++t) {
    scores[t] = fast_exp(scores[t] - m);
    sum += scores[t];
  }
  return 1.0f / sum;
}

struct DecodeShape {
  int64_t num_reqs, num_heads, num_kv_heads, group, head_dim, num_blocks, block_size, max_blocks;
};

// One (request, kv head): the `group` query heads sharing that KV head attend over the
// request's seq_len keys, read block by block through its block table.
template <class D>
void decode_one(const DecodeShape& s, int64_t req, int64_t kvh, const typename D::T* q, int64_t qst,
                const typename D::T* kc, const typename D::T* vc, const int64_t* table, int64_t seq_len,
                float scale, typename D::T* out, std::vector<float>& scores, std::vector<float>& acc) {
  using T = typename D::T;
  const int64_t g = s.group, d = s.head_dim, bs = s.block_size;
  const int64_t block_stride = s.num_kv_heads * bs * d;
  float qf[8][256];
  for (int64_t j = 0; j < g; ++j) {
    const T* qr = q + req * qst + (kvh * g + j) * d;
    for (int64_t i = 0; i < d; ++i) qf[j][i] = D::load(qr[i]) * scale;
  }
  scores.resize(g * seq_len);
  acc.assign(g * d, 0.0f);
  const int64_t used_blocks = (seq_len + bs - 1) / bs;
  for (int64_t b = 0; b < used_blocks; ++b) {
    const T* kb = kc + table[b] * block_stride + kvh * bs * d;
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t t = 0; t < num; ++t) {
      const T* kr = kb + t * d;
      for (int64_t j = 0; j < g; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qf[j][i] * D::load(kr[i]);
        scores[j * seq_len + b * bs + t] = dot;
      }
    }
  }
  float inv_sum[8];
  for (int64_t j = 0; j < g; ++j) inv_sum[j] = exp_shifted(scores.data() + j * seq_len, seq_len);
  for (int64_t b = 0; b < used_blocks; ++b) {
    const T* vb = vc + table[b] * block_stride + kvh * bs * d;
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t t = 0; t < num; ++t) {
      const T* vr = vb + t * d;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * seq_len + b * bs + t];
        float* aj = acc.data() + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) aj[i] += p * D::load(vr[i]);
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    T* orow = out + (req * s.num_heads + kvh * g + j) * d;
    for (int64_t i = 0; i < d; ++i) orow[i] = D::store(acc[j * d + i] * inv_sum[j]);
  }
}

#ifdef SPLITSERVE_AVX512_BF16
// One vector whose lane t holds the sum of v[t]'s 16 lanes (a transpose-and-add tree: 45
// shuffles and adds for 16 dot products, against about 10 instructions each one by one).
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// out[t] = scale * q . k_t for the num <= 16 bf16 key rows at k (q: d / 32 bf16 vectors).
inline void qk_tile(const __m512bh* q, int64_t nq, const uint16_t* k, int64_t d, int64_t num,
                    float scale, float* out) {
  __m512 acc[16];
  for (int64_t t = 0; t < 16; ++t) {
    __m512 a = _mm512_setzero_ps();
    if (t < num)
      for (int64_t c = 0; c < nq; ++c)
        a = _mm512_dpbf16_ps(a, q[c], (__m512bh)_mm512_loadu_si512(k + t * d + 32 * c));
    acc[t] = a;
  }
  const __m512 r = _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, __mmask16((1u << num) - 1u), r);
}

inline uint32_t bf16_pair(float a, float b) {
  return uint32_t(BF16::store(a)) | (uint32_t(BF16::store(b)) << 16);
}


// Scratch of one thread's decodes: scores [heads, seq_len], the query heads as bf16 vectors, and
// the float32 accumulators of the values (lanes permuted by the interleave, see below).
struct DecodeScratch {
  std::vector<float> scores;
  std::vector<__m512bh> queries;
  std::vector<__m512> acc;
};

// acc += p v over the num value rows of one block of kv head `local` (its g query heads'
// probabilities start at column `pos` of their score rows): two rows per step, interleaved
// into bf16 pairs, so lane 4k + i of the lo (hi) accumulator of chunk c holds dimension
// 32c + 8k + i (+ 4).
void pv_block(DecodeScratch& x, int64_t local, int64_t g, int64_t nq, const uint16_t* vb,
              int64_t d, int64_t num, int64_t seq_len, int64_t pos) {
  for (int64_t t = 0; t < num; t += 2) {
    const bool is_pair = t + 1 < num;
    const uint16_t* v0 = vb + t * d;
    const uint16_t* v1 = is_pair ? v0 + d : v0;  // a lone last row pairs with itself at p = 0
    __m512i lo[8], hi[8];
    for (int64_t c = 0; c < nq; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), e = _mm512_loadu_si512(v1 + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(a, e);
      hi[c] = _mm512_unpackhi_epi16(a, e);
    }
    for (int64_t j = local * g; j < (local + 1) * g; ++j) {
      const float* pj = x.scores.data() + j * seq_len + pos + t;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int32_t(bf16_pair(pj[0], is_pair ? pj[1] : 0.0f)));
      __m512* acc = &x.acc[j * 2 * nq];
      for (int64_t c = 0; c < nq; ++c) {
        acc[2 * c] = _mm512_dpbf16_ps(acc[2 * c], (__m512bh)lo[c], p);
        acc[2 * c + 1] = _mm512_dpbf16_ps(acc[2 * c + 1], (__m512bh)hi[c], p);
      }
    }
  }
}

// softmax(q k^T * scale) v of one request's query heads sharing kv heads [h0, h1), in bf16 with
// AVX512-BF16 dot products: scores 16 keys at a time, values two rows at a time (interleaved
// pairs; probabilities in bf16 as the matmul path has them), accumulators in float32. Blocks
// are the outer loop, so a block's kv heads are read in cache order (one contiguous span).
void decode_heads_avx512(const DecodeShape& s, int64_t req, int64_t h0, int64_t h1,
                         const uint16_t* q, int64_t qst, const uint16_t* kc, const uint16_t* vc,
                         const int64_t* table, int64_t seq_len, float scale, uint16_t* out,
                         DecodeScratch& x) {
  const int64_t g = s.group, d = s.head_dim, bs = s.block_size, nq = d / 32;
  const int64_t block_stride = s.num_kv_heads * bs * d, first = h0 * g, heads = (h1 - h0) * g;
  const int64_t used_blocks = (seq_len + bs - 1) / bs;
  x.scores.resize(heads * seq_len);
  x.queries.resize(heads * nq);
  x.acc.assign(heads * 2 * nq, _mm512_setzero_ps());
  for (int64_t j = 0; j < heads; ++j)
    for (int64_t c = 0; c < nq; ++c)
      x.queries[j * nq + c] = (__m512bh)_mm512_loadu_si512(q + req * qst + (first + j) * d + 32 * c);
  for (int64_t b = 0; b < used_blocks; ++b) {
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t h = h0; h < h1; ++h) {
      const uint16_t* kb = kc + table[b] * block_stride + h * bs * d;
      for (int64_t t = 0; t < num; t += 16)
        for (int64_t j = (h - h0) * g; j < (h - h0 + 1) * g; ++j)
          qk_tile(&x.queries[j * nq], nq, kb + t * d, d, std::min<int64_t>(16, num - t), scale,
                  x.scores.data() + j * seq_len + b * bs + t);
    }
  }
  std::vector<float> inv_sum(heads);
  for (int64_t j = 0; j < heads; ++j) inv_sum[j] = exp_shifted(x.scores.data() + j * seq_len, seq_len);
  for (int64_t b = 0; b < used_blocks; ++b) {
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t h = h0; h < h1; ++h)
      pv_block(x, h - h0, g, nq, vc + table[b] * block_stride + h * bs * d, d, num,
               seq_len, b * bs);
  }
  alignas(64) float lanes[16];
  for (int64_t j = 0; j < heads; ++j) {
    uint16_t* orow = out + (req * s.num_heads + first + j) * d;
    for (int64_t c = 0; c < 2 * nq; ++c) {  // lane 4k + i of the lo (hi) half: d = 32 (c / 2) + 8k + i (+ 4)
      _mm512_store_ps(lanes, _mm512_mul_ps(x.acc[j * 2 * nq + c], _mm512_set1_ps(inv_sum[j])));
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) orow[32 * (c / 2) + 8 * k + 4 * (c % 2) + i] = BF16::store(lanes[4 * k + i]);
    }
  }
}
#endif

// out [reqs, heads, head_dim] = softmax(q k^T * scale) v for each request's one query token
// over kv_cache [2, num_blocks, kv_heads, block_size, head_dim], through block_tables
// [reqs, max_blocks] (int64) and seq_lens [reqs] (int64).
void paged_decode_attention(Tensor out, Tensor query, Tensor kv_cache, Tensor block_tables,
                            Tensor seq_lens, double scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, kv_heads, block_size, head_dim]");
  DecodeShape s{query.size(0), query.size(1), kv_cache.size(2), 0, kv_cache.size(4),
                kv_cache.size(1), kv_cache.size(3), block_tables.size(1)};
  TORCH_CHECK(query.dim() == 3 && query.size(2) == s.head_dim && query.stride(2) == 1 &&
                  query.stride(1) == s.head_dim, "query must be [reqs, heads, head_dim] with packed heads");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "heads must be a multiple of kv heads");
  s.group = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(s.group <= 8 && s.head_dim <= 256, "at most 8 query heads per kv head and head_dim 256");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous like query");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, kv_cache and out must have one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == s.num_reqs,
              "block_tables must be contiguous int64 [reqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == s.num_reqs, "seq_lens must be int64 [reqs]");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= s.max_blocks * s.block_size, "seq_len ", lens[r],
                " does not fit the block table");
    const int64_t used = (lens[r] + s.block_size - 1) / s.block_size;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tables[r * s.max_blocks + b] >= 0 && tables[r * s.max_blocks + b] < s.num_blocks,
                  "block id ", tables[r * s.max_blocks + b], " outside the cache");
  }
#ifdef SPLITSERVE_AVX512_BF16
  if (query.scalar_type() == at::kBFloat16 && s.head_dim % 32 == 0) {
    const auto* kc = ptr<BF16>(kv_cache);
    const auto* vc = kc + s.num_blocks * s.num_kv_heads * s.block_size * s.head_dim;
    const auto* q = ptr<BF16>(query);
    auto* o = ptr<BF16>(out);
    const int64_t qst = query.stride(0);
    // A task is a request (its blocks read in cache order) when there are enough of them to
    // share out, else one kv head of a request.
    const int64_t split = s.num_reqs >= 2 * at::get_num_threads() ? 1 : s.num_kv_heads;
    at::parallel_for(0, s.num_reqs * split, 1, [&](int64_t begin, int64_t end) {
      DecodeScratch scratch;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t req = task / split, h0 = (task % split) * s.num_kv_heads / split;
        const int64_t h1 = h0 + s.num_kv_heads / split;
        decode_heads_avx512(s, req, h0, h1, q, qst, kc, vc, tables + req * s.max_blocks,
                            lens[req], float(scale), o, scratch);
      }
    });
    return;
  }
#endif
  dispatch(query, [&](auto tag) {
    using D = decltype(tag);
    const auto* kc = ptr<D>(kv_cache);
    const auto* vc = kc + s.num_blocks * s.num_kv_heads * s.block_size * s.head_dim;
    const auto* q = ptr<D>(query);
    auto* o = ptr<D>(out);
    const int64_t qst = query.stride(0);
    at::parallel_for(0, s.num_reqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t req = task / s.num_kv_heads, kvh = task % s.num_kv_heads;
        decode_one<D>(s, req, kvh, q, qst, kc, vc, tables + req * s.max_blocks, lens[req],
                      float(scale), o, scores, acc);
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
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor runs, Tensor col_offsets, Tensor slot_ranks) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_neox_", rotary_neox_);
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("lora_add_", lora_add_);
}
