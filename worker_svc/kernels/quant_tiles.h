// The tile kernels of quant_ops.cpp and w8a8_ops.cpp: one 16-row tile of a quantized weight against a block
// of MB activation rows, results in float32 (before bias and rounding).
//
// The packed layout (worker_svc/layers/quant_pack.py writes it): output rows in tiles of 16,
// input columns in chunks of 4.
//   int8 (W8A16, "pairs"): tile[c][32p + 2i + j] = q[16t + i][4c + 2p + j]             64 B/chunk
//   int8 (W8A8, "quads"):  tile[c][4i + j]       = q[16t + i][4c + j]                   64 B/chunk
//   int4:                  tile[c][2i + j]       = q[16t + i][4c + j] | q[16t + i][4c + 2 + j] << 4
//                                                                                      32 B/chunk
// Group g of a tile covers chunks [bounds[g], bounds[g + 1]) and has 16 scales and (optionally)
// 16 offsets: w = scale * q + offset. Sums run per group, then
//   out += scale * sum_k(x_k q_k) + offset * sum_k(x_k),
// the second term from the group sums of x computed once per row (xs).
//
// Each kernel has a portable version (any compiler, any x86-64 or other CPU) and, where the
// compiler targets them, AVX-512 versions: int8 and int4 against float32 activations
// (AVX512F/BW), int4 against bfloat16 activations with the bf16 dot product (AVX512_BF16), and
// the int8 x int8 dot product of W8A8 (AVX512_VNNI).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SPLITSERVE_QUANT_AVX512 1
#endif

namespace splitserve::quant {

constexpr int64_t TILE = 16;

// Where a tile's inputs are (the AVX-512 kernels take NT neighbouring tiles at once); the
// activation rows are x[m * x_stride ...].
struct TileArgs {
  const uint8_t* weight;  // the first tile's chunks
  int64_t tile_bytes;     // from one tile's chunks to the next's
  const void* scales;     // [groups][16] per tile, float or c10::Half
  const void* offsets;    // [groups][16] per tile, or nullptr
  int64_t scale_stride;   // elements from one tile's scales to the next's
  const int32_t* bounds;  // [groups + 1]
  int64_t num_groups;
  const void* x;          // float rows (or bf16 pairs for the bf16 kernels)
  int64_t x_stride;       // elements per row of x
  const float* xs;        // group sums [m][groups]
};

template <class S>
inline float scale_at(const void* p, int64_t idx) {
  return float(static_cast<const S*>(p)[idx]);
}

// out[m][i] for m < mb: the portable version, for either width.
template <int BITS, class S>
void tile_generic(const TileArgs& a, int64_t mb, float (*out)[TILE]) {
  const auto* xf = static_cast<const float*>(a.x);
  constexpr int64_t chunk_bytes = BITS == 8 ? 64 : 32;
  for (int64_t m = 0; m < mb; ++m) {
    float tot[TILE] = {};
    const float* xr = xf + m * a.x_stride;
    for (int64_t g = 0; g < a.num_groups; ++g) {
      float acc[TILE] = {};
      for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
        const uint8_t* w = a.weight + c * chunk_bytes;
        for (int64_t j = 0; j < 4; ++j) {
          const float xv = xr[4 * c + j];
          for (int64_t i = 0; i < TILE; ++i) {
            float q;
            if constexpr (BITS == 8) {
              q = float(int8_t(w[32 * (j >> 1) + 2 * i + (j & 1)]));
            } else {
              const uint8_t b = w[2 * i + (j & 1)];
              q = float(j < 2 ? (b & 15) : (b >> 4));
            }
            acc[i] += q * xv;
          }
        }
      }
      const float sum = a.xs ? a.xs[m * a.num_groups + g] : 0.0f;
      for (int64_t i = 0; i < TILE; ++i) {
        tot[i] += scale_at<S>(a.scales, g * TILE + i) * acc[i];
        if (a.offsets) tot[i] += scale_at<S>(a.offsets, g * TILE + i) * sum;
      }
    }
    for (int64_t i = 0; i < TILE; ++i) out[m][i] = tot[i];
  }
}

// W8A8: int32 dot products of u8 activations (q + 128, chunks of 4 as uint32) and int8 weights.
inline void tile_w8a8_generic(const uint8_t* weight, int64_t num_chunks, const uint32_t* xq,
                              int64_t x_stride, int64_t mb, int32_t (*out)[TILE]) {
  for (int64_t m = 0; m < mb; ++m) {
    int32_t acc[TILE] = {};
    const auto* xr = reinterpret_cast<const uint8_t*>(xq + m * x_stride);
    for (int64_t c = 0; c < num_chunks; ++c)
      for (int64_t i = 0; i < TILE; ++i)
        for (int64_t j = 0; j < 4; ++j)
          acc[i] += int32_t(xr[4 * c + j]) * int32_t(int8_t(weight[c * 64 + 4 * i + j]));
    for (int64_t i = 0; i < TILE; ++i) out[m][i] = acc[i];
  }
}

#ifdef SPLITSERVE_QUANT_AVX512
template <class S>
inline __m512 load_scales(const void* p, int64_t idx) {
  if constexpr (sizeof(S) == 2)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const c10::Half*>(p) + idx)));
  else
    return _mm512_loadu_ps(static_cast<const float*>(p) + idx);
}

// The NT x MB kernels write out[t * MB + m] (tile t, token m), starting from zeros.
template <int NT, int MB>
inline void zero_tiles(float (*out)[TILE]) {
  for (int i = 0; i < NT * MB; ++i) _mm512_storeu_ps(out[i], _mm512_setzero_ps());
}

// After a group's sums `acc`: out += scale * acc + offset * xs (the offset shifted by
// `magic` x scale where the sums ran over q + magic).
template <int NT, int MB, class S>
inline void close_group(const TileArgs& a, int64_t g, const __m512 (&acc)[NT][MB],
                        float (*out)[TILE], float magic) {
  const bool has_sum = a.offsets || magic != 0.0f;
  for (int t = 0; t < NT; ++t) {
    const int64_t idx = t * a.scale_stride + g * TILE;
    const __m512 s = load_scales<S>(a.scales, idx);
    __m512 o = a.offsets ? load_scales<S>(a.offsets, idx) : _mm512_setzero_ps();
    if (magic != 0.0f) o = _mm512_fnmadd_ps(_mm512_set1_ps(magic), s, o);
    for (int m = 0; m < MB; ++m) {
      __m512 tot = _mm512_fmadd_ps(acc[t][m], s, _mm512_loadu_ps(out[t * MB + m]));
      if (has_sum) tot = _mm512_fmadd_ps(o, _mm512_set1_ps(a.xs[m * a.num_groups + g]), tot);
      _mm512_storeu_ps(out[t * MB + m], tot);
    }
  }
}

template <int NT, int MB>
inline void zero_acc(__m512 (&acc)[NT][MB]) {
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MB; ++m) acc[t][m] = _mm512_setzero_ps();
}

// int8 weights ("pairs"), float32 activations: 16 bytes sign-extended give rows 8h .. 8h + 7 of
// two columns, lane 2i + j = (row 8h + i, column 4c + 2p + j), multiplied by the two columns'
// activations repeated; each group's lanes are summed in pairs at its end.
template <int NT, int MB, class S>
void tile_int8_f32(const TileArgs& a, float (*out)[TILE]) {
  static_assert(NT == 1);
  const auto* xf = static_cast<const float*>(a.x);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  zero_tiles<NT, MB>(out);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512 acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
      const uint8_t* w = a.weight + c * 64;
      for (int p = 0; p < 2; ++p) {
        __m512 q[2];
        for (int h = 0; h < 2; ++h)
          q[h] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * p + 16 * h))));
        for (int m = 0; m < MB; ++m) {
          double pair;
          __builtin_memcpy(&pair, xf + m * a.x_stride + 4 * c + 2 * p, sizeof(pair));
          const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair));
          acc[m][0] = _mm512_fmadd_ps(q[0], xv, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(q[1], xv, acc[m][1]);
        }
      }
    }
    __m512 sums[1][MB];
    for (int m = 0; m < MB; ++m)
      sums[0][m] = _mm512_add_ps(_mm512_permutex2var_ps(acc[m][0], even, acc[m][1]),
                                 _mm512_permutex2var_ps(acc[m][0], odd, acc[m][1]));
    close_group<1, MB, S>(a, g, sums, out, 0.0f);
  }
}

// int4 weights, float32 activations: the 16 bits of row i's two bytes hold columns
// 4c, 4c + 2, 4c + 1, 4c + 3 (a nibble each, low to high).
template <int NT, int MB, class S>
void tile_int4_f32(const TileArgs& a, float (*out)[TILE]) {
  const auto* xf = static_cast<const float*>(a.x);
  const __m512i nibble = _mm512_set1_epi32(15);
  constexpr int shift[4] = {0, 8, 4, 12};
  zero_tiles<NT, MB>(out);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512 acc[NT][MB];
    zero_acc(acc);
    for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
      __m512i d[NT];
      for (int t = 0; t < NT; ++t)
        d[t] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.weight + t * a.tile_bytes + c * 32)));
      for (int j = 0; j < 4; ++j) {
        __m512 q[NT];
        for (int t = 0; t < NT; ++t)
          q[t] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d[t], shift[j]), nibble));
        for (int m = 0; m < MB; ++m) {
          const __m512 xv = _mm512_set1_ps(xf[m * a.x_stride + 4 * c + j]);
          for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_fmadd_ps(q[t], xv, acc[t][m]);
        }
      }
    }
    close_group<NT, MB, S>(a, g, acc, out, 0.0f);
  }
}

#ifdef __AVX512BF16__
#define SPLITSERVE_QUANT_BF16 1
// int4 weights, bfloat16 activations (x: pairs of bf16 as uint32, x_stride in pairs): each
// nibble q becomes the bf16 number 128 + q (0x4300 | q, exact), so one dot-product instruction
// takes 32 weights; close_group takes the 128 x sum(x) back out.
template <int NT, int MB, class S>
void tile_int4_bf16(const TileArgs& a, float (*out)[TILE]) {
  const auto* xp = static_cast<const uint32_t*>(a.x);
  const __m512i low = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  zero_tiles<NT, MB>(out);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512 acc[NT][MB];
    zero_acc(acc);
    for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
      __m512bh lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        const __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.weight + t * a.tile_bytes + c * 32)));
        lo[t] = (__m512bh)_mm512_ternarylogic_epi32(z, low, magic, 0xEA);  // (z & low) | magic
        hi[t] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(z, 4), magic);
      }
      for (int m = 0; m < MB; ++m) {
        const uint32_t* xr = xp + m * a.x_stride + 2 * c;
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(int32_t(xr[0]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(int32_t(xr[1]));
        for (int t = 0; t < NT; ++t) {
          acc[t][m] = _mm512_dpbf16_ps(acc[t][m], lo[t], x0);
          acc[t][m] = _mm512_dpbf16_ps(acc[t][m], hi[t], x1);
        }
      }
    }
    close_group<NT, MB, S>(a, g, acc, out, 128.0f);
  }
}

// int8 weights ("pairs"), bfloat16 activations: each 16 bytes (8 rows x 2 columns) become
// float32 then, two halves together, bf16 (exact: |q| <= 128 has 8 significant bits), lane i =
// row i's two columns, against the two columns' activations as one bf16 pair.
template <int NT, int MB, class S>
void tile_int8_bf16(const TileArgs& a, float (*out)[TILE]) {
  const auto* xp = static_cast<const uint32_t*>(a.x);
  zero_tiles<NT, MB>(out);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    __m512 acc[NT][MB];
    zero_acc(acc);
    for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
      for (int p = 0; p < 2; ++p) {
        __m512bh w[NT];
        for (int t = 0; t < NT; ++t) {
          const uint8_t* src = a.weight + t * a.tile_bytes + c * 64 + 32 * p;
          const __m512 rows0 = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
          const __m512 rows8 = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
          w[t] = _mm512_cvtne2ps_pbh(rows8, rows0);
        }
        for (int m = 0; m < MB; ++m) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(xp[m * a.x_stride + 2 * c + p]));
          for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_dpbf16_ps(acc[t][m], w[t], xv);
        }
      }
    }
    close_group<NT, MB, S>(a, g, acc, out, 0.0f);
  }
}
#endif

#ifdef __AVX512VNNI__
#define SPLITSERVE_QUANT_VNNI 1
// W8A8: u8 activations (4 per uint32) x int8 weights ("quads"), 64 products per instruction.
template <int NT, int MB>
void tile_w8a8_vnni(const uint8_t* weight, int64_t tile_bytes, int64_t num_chunks,
                    const uint32_t* xq, int64_t x_stride, int32_t (*out)[TILE]) {
  __m512i acc[NT][MB];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MB; ++m) acc[t][m] = _mm512_setzero_si512();
  for (int64_t c = 0; c < num_chunks; ++c) {
    __m512i w[NT];
    for (int t = 0; t < NT; ++t) w[t] = _mm512_loadu_si512(weight + t * tile_bytes + c * 64);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_set1_epi32(int32_t(xq[m * x_stride + c]));
      for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_dpbusd_epi32(acc[t][m], xv, w[t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MB; ++m) _mm512_storeu_si512(out[t * MB + m], acc[t][m]);
}
#endif
#endif  // SPLITSERVE_QUANT_AVX512

}  // namespace splitserve::quant
