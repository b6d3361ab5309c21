// paged_decode_attention (torch.ops.splitserve): one query token per request over its paged
// KV cache, read in place through the block table (no gather copy). The cache holds the
// query's dtype, or fp8 (float8_e4m3fn / float8_e5m2: keys / k_scale and values / v_scale,
// converted to float32 or bf16 in registers as they are read). Scores and sums are float32; with
// bf16 queries on AVX512-BF16 machines it takes the bf16 dot-product instructions, with the
// probabilities rounded to bf16 as the matmul path (worker_svc.attention) has them (that path
// and what both share: attention_decode.h). Built with cpu_ops.cpp by
// worker_svc/kernels/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_decode.h"
#include "cpu_common.h"

namespace {

using at::Tensor;
using splitserve::dispatch;
using splitserve::ptr;
using namespace splitserve::attention;

// One (request, kv head): the `group` query heads sharing that KV head attend over the
// request's seq_len keys, read block by block through its block table. The cache holds C
// values (D's, or fp8: then `scale` includes k_scale and the outputs are multiplied by
// v_scale); each key and value row is converted to float32 once for all the group's heads.
template <class D, class C>
void decode_one(const DecodeShape& s, int64_t req, int64_t kvh, const typename D::T* q, int64_t qst,
                const typename C::T* kc, const typename C::T* vc, const int64_t* table,
                int64_t seq_len, float scale, float v_scale, typename D::T* out,
                std::vector<float>& scores, std::vector<float>& acc) {
  using T = typename D::T;
  using CT = typename C::T;
  const int64_t g = s.group, d = s.head_dim, bs = s.block_size;
  const int64_t block_stride = s.num_kv_heads * bs * d;
  float qf[8][256], row[256];
  for (int64_t j = 0; j < g; ++j) {
    const T* qr = q + req * qst + (kvh * g + j) * d;
    for (int64_t i = 0; i < d; ++i) qf[j][i] = D::load(qr[i]) * scale;
  }
  scores.resize(g * seq_len);
  acc.assign(g * d, 0.0f);
  const int64_t used_blocks = (seq_len + bs - 1) / bs;
  for (int64_t b = 0; b < used_blocks; ++b) {
    const CT* kb = kc + table[b] * block_stride + kvh * bs * d;
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t t = 0; t < num; ++t) {
      const CT* kr = kb + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = C::load(kr[i]);
      for (int64_t j = 0; j < g; ++j) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qf[j][i] * row[i];
        scores[j * seq_len + b * bs + t] = dot;
      }
    }
  }
  float inv_sum[8];
  for (int64_t j = 0; j < g; ++j)
    inv_sum[j] = exp_shifted(scores.data() + j * seq_len, seq_len) * v_scale;
  for (int64_t b = 0; b < used_blocks; ++b) {
    const CT* vb = vc + table[b] * block_stride + kvh * bs * d;
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t t = 0; t < num; ++t) {
      const CT* vr = vb + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = C::load(vr[i]);
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * seq_len + b * bs + t];
        float* aj = acc.data() + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) aj[i] += p * row[i];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    T* orow = out + (req * s.num_heads + kvh * g + j) * d;
    for (int64_t i = 0; i < d; ++i) orow[i] = D::store(acc[j * d + i] * inv_sum[j]);
  }
}

// The generic decodes: one task per (request, kv head), query dtype D over a cache of C.
template <class D, class C>
void decode_generic(const DecodeShape& s, const Tensor& out, const Tensor& query,
                    const Tensor& kv_cache, const int64_t* tables, const int64_t* lens, float scale,
                    float v_scale) {
  const auto* kc = ptr<C>(kv_cache);
  const auto* vc = kc + s.num_blocks * s.num_kv_heads * s.block_size * s.head_dim;
  const auto* q = ptr<D>(query);
  auto* o = ptr<D>(out);
  const int64_t qst = query.stride(0);
  at::parallel_for(0, s.num_reqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t req = task / s.num_kv_heads, kvh = task % s.num_kv_heads;
      decode_one<D, C>(s, req, kvh, q, qst, kc, vc, tables + req * s.max_blocks, lens[req], scale,
                       v_scale, o, scores, acc);
    }
  });
}

DecodeShape check_decode(const Tensor& out, const Tensor& query, const Tensor& kv_cache,
                         const Tensor& block_tables, const Tensor& seq_lens, double k_scale,
                         double v_scale) {
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
  const bool is_fp8 = splitserve::is_fp8(kv_cache);
  TORCH_CHECK((is_fp8 || query.scalar_type() == kv_cache.scalar_type()) &&
                  out.scalar_type() == query.scalar_type(),
              "query and out must have one dtype, kv_cache that dtype or float8_e4m3fn/e5m2");
  TORCH_CHECK(std::isfinite(k_scale) && std::isfinite(v_scale) && k_scale > 0 && v_scale > 0 &&
                  (is_fp8 || (k_scale == 1.0 && v_scale == 1.0)),
              "k_scale and v_scale must be positive and finite, and 1 unless the cache is fp8");
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
  return s;
}

// out [reqs, heads, head_dim] = softmax(q k^T * scale) v for each request's one query token
// over kv_cache [2, num_blocks, kv_heads, block_size, head_dim], through block_tables
// [reqs, max_blocks] (int64) and seq_lens [reqs] (int64). An fp8 cache (float8_e4m3fn or
// float8_e5m2) holds keys / k_scale and values / v_scale.
void paged_decode_attention(Tensor out, Tensor query, Tensor kv_cache, Tensor block_tables,
                            Tensor seq_lens, double scale, double k_scale, double v_scale) {
  const DecodeShape s = check_decode(out, query, kv_cache, block_tables, seq_lens, k_scale, v_scale);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
#ifdef SPLITSERVE_AVX512_BF16
  if (query.scalar_type() == at::kBFloat16 && s.head_dim % 32 == 0) {
    switch (kv_cache.scalar_type()) {
      case at::kBFloat16: return decode_avx512<Bf16Rows>(s, out, query, kv_cache, tables, lens, scale, 1.0f);
      case at::kFloat8_e4m3fn:
        return decode_avx512<E4M3Rows>(s, out, query, kv_cache, tables, lens, scale * k_scale, v_scale);
      case at::kFloat8_e5m2:
        return decode_avx512<E5M2Rows>(s, out, query, kv_cache, tables, lens, scale * k_scale, v_scale);
      default: break;
    }
  }
#endif
  const float qk_scale = float(scale * k_scale), pv_scale = float(v_scale);
  dispatch(query, [&](auto dtag) {
    using D = decltype(dtag);
    if (!splitserve::is_fp8(kv_cache)) {
      decode_generic<D, D>(s, out, query, kv_cache, tables, lens, qk_scale, pv_scale);
      return;
    }
    splitserve::dispatch_fp8(kv_cache, [&](auto ctag) {
      decode_generic<D, decltype(ctag)>(s, out, query, kv_cache, tables, lens, qk_scale, pv_scale);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
