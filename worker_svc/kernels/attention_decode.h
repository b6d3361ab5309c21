// What paged_decode_attention's paths share (attention_ops.cpp: the checks, the generic path
// and the dispatch), and its AVX512-BF16 path: bf16 queries over a bf16 or fp8 cache, scores
// and sums in float32 from the bf16 dot-product instructions, the probabilities rounded to bf16
// as the matmul path (worker_svc.attention) has them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

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

namespace splitserve::attention {

// scores[t] = exp(scores[t] - max) in place; returns 1 / their sum (the softmax's scale).
inline float exp_shifted(float* scores, int64_t num) {
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

}  // namespace splitserve::attention
