// paged_decode_attention (torch.ops.splitserve): one query token per request over its paged
// KV cache, read in place through the block table (no gather copy). The cache holds the
// query's dtype, or fp8 (float8_e4m3fn / float8_e5m2: keys / k_scale and values / v_scale,
// converted to float32 or bf16 in registers as they are read). Scores and sums are float32; with
// bf16 queries on AVX512-BF16 machines it takes the bf16 dot-product instructions, with the
// probabilities rounded to bf16 as the matmul path (worker_svc.attention) has them. Built with
// cpu_ops.cpp by worker_svc/kernels/cpu_kernels.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
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
using splitserve::fast_exp;
using splitserve::ptr;

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

// 32 cached values as bf16 lanes: a bf16 cache's as they are, an fp8 cache's converted exactly
// (every e4m3/e5m2 value is a bf16 value): the exponent moved into place, subnormals (exponent
// field 0) looked up, NaN (and e5m2's infinity) kept, the sign put back.
struct Bf16Rows {
  using T = uint16_t;
  static inline __m512i load32(const uint16_t* p) { return _mm512_loadu_si512(p); }
};

constexpr uint16_t bf16_bits(float f) { return uint16_t(std::bit_cast<uint32_t>(f) >> 16); }

template <int MANTISSA, int BIAS>
struct Fp8Rows {
  using T = uint8_t;
  static constexpr uint16_t EXP_ALL = uint16_t(0x7f >> MANTISSA);  // the exponent field's max
  static inline __m512i load32(const uint8_t* p) {
    static const __m512i subnormals = [] {  // m x 2^(1 - BIAS - MANTISSA) for m < 2^MANTISSA
      alignas(64) uint16_t lanes[32] = {};
      for (int m = 1; m < (1 << MANTISSA); ++m)
        lanes[m] = bf16_bits(float(m) * std::ldexp(1.0f, 1 - BIAS - MANTISSA));
      return _mm512_load_si512(lanes);
    }();
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 7 - MANTISSA),
                                 _mm512_set1_epi16(int16_t((127 - BIAS) << 7)));
    v = _mm512_mask_permutexvar_epi16(
        v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(1 << MANTISSA)), mag, subnormals);
    if constexpr (MANTISSA == 3) {  // e4m3fn: no infinities, NaN = all ones
      v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                                _mm512_set1_epi16(0x7fc0));
    } else {  // e5m2: exponent all ones = infinity (mantissa 0) or NaN
      const __m512i top = _mm512_set1_epi16(int16_t(EXP_ALL << MANTISSA));
      v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(mag, top), _mm512_set1_epi16(0x7f80));
      v = _mm512_mask_mov_epi16(v, _mm512_cmpgt_epu16_mask(mag, top), _mm512_set1_epi16(0x7fc0));
    }
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
  }
};
using E4M3Rows = Fp8Rows<3, 7>;
using E5M2Rows = Fp8Rows<2, 15>;

// `num` contiguous key rows of width d as bf16: a bf16 cache's in place, an fp8 cache's
// converted into `tile` (once for all the query heads that read them).
template <class R>
inline const uint16_t* bf16_rows(const typename R::T* rows, int64_t num, int64_t d, uint16_t* tile) {
  if constexpr (std::is_same_v<R, Bf16Rows>) {
    return rows;
  } else {
    for (int64_t i = 0; i < num * d; i += 32) _mm512_storeu_si512(tile + i, R::load32(rows + i));
    return tile;
  }
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
  uint16_t keys[16 * 256];  // an fp8 tile of keys, as bf16
};

// acc += p v over the num value rows of one block of kv head `local` (its g query heads'
// probabilities start at column `pos` of their score rows): two rows per step, interleaved
// into bf16 pairs, so lane 4k + i of the lo (hi) accumulator of chunk c holds dimension
// 32c + 8k + i (+ 4).
template <class R>
void pv_block(DecodeScratch& x, int64_t local, int64_t g, int64_t nq, const typename R::T* vb,
              int64_t d, int64_t num, int64_t seq_len, int64_t pos) {
  for (int64_t t = 0; t < num; t += 2) {
    const bool is_pair = t + 1 < num;
    const typename R::T* v0 = vb + t * d;
    const typename R::T* v1 = is_pair ? v0 + d : v0;  // a lone last row pairs with itself at p = 0
    __m512i lo[8], hi[8];
    for (int64_t c = 0; c < nq; ++c) {
      const __m512i a = R::load32(v0 + 32 * c), e = R::load32(v1 + 32 * c);
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
// are the outer loop, so a block's kv heads are read in cache order (one contiguous span). An
// fp8 cache (R: Fp8Rows) is converted to bf16 as it is read: `scale` then includes k_scale,
// and the outputs are multiplied by `v_scale`.
template <class R>
void decode_heads_avx512(const DecodeShape& s, int64_t req, int64_t h0, int64_t h1,
                         const uint16_t* q, int64_t qst, const typename R::T* kc,
                         const typename R::T* vc, const int64_t* table, int64_t seq_len,
                         float scale, float v_scale, uint16_t* out, DecodeScratch& x) {
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
      const typename R::T* kb = kc + table[b] * block_stride + h * bs * d;
      for (int64_t t = 0; t < num; t += 16) {
        const int64_t rows = std::min<int64_t>(16, num - t);
        const uint16_t* keys = bf16_rows<R>(kb + t * d, rows, d, x.keys);
        for (int64_t j = (h - h0) * g; j < (h - h0 + 1) * g; ++j)
          qk_tile(&x.queries[j * nq], nq, keys, d, rows, scale,
                  x.scores.data() + j * seq_len + b * bs + t);
      }
    }
  }
  std::vector<float> inv_sum(heads);
  for (int64_t j = 0; j < heads; ++j)
    inv_sum[j] = exp_shifted(x.scores.data() + j * seq_len, seq_len) * v_scale;
  for (int64_t b = 0; b < used_blocks; ++b) {
    const int64_t num = std::min(bs, seq_len - b * bs);
    for (int64_t h = h0; h < h1; ++h)
      pv_block<R>(x, h - h0, g, nq, vc + table[b] * block_stride + h * bs * d, d, num,
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

#ifdef SPLITSERVE_AVX512_BF16
// The AVX512-BF16 decodes of bf16 queries over a cache of R rows. A task is a request (its
// blocks read in cache order) when there are enough of them to share out, else one kv head of
// a request.
template <class R>
void decode_avx512(const DecodeShape& s, const Tensor& out, const Tensor& query,
                   const Tensor& kv_cache, const int64_t* tables, const int64_t* lens, double scale,
                   double v_scale) {
  const auto* kc = static_cast<const typename R::T*>(kv_cache.data_ptr());
  const auto* vc = kc + s.num_blocks * s.num_kv_heads * s.block_size * s.head_dim;
  const auto* q = ptr<BF16>(query);
  auto* o = ptr<BF16>(out);
  const int64_t qst = query.stride(0);
  const int64_t split = s.num_reqs >= 2 * at::get_num_threads() ? 1 : s.num_kv_heads;
  at::parallel_for(0, s.num_reqs * split, 1, [&](int64_t begin, int64_t end) {
    DecodeScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t req = task / split, h0 = (task % split) * s.num_kv_heads / split;
      const int64_t h1 = h0 + s.num_kv_heads / split;
      decode_heads_avx512<R>(s, req, h0, h1, q, qst, kc, vc, tables + req * s.max_blocks,
                             lens[req], float(scale), float(v_scale), o, scratch);
    }
  });
}
#endif

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
