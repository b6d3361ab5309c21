// Weights in the tile layout (quant_tiles.h) converted for steps of many tokens:
// - dequantize_tiles: W^T for a matmul (float32/float16 steps, builds without AVX512_BF16), one
//   tile's 16 output rows at a time, out[4c + j][16t + i] = scale * q + offset ([chunks x 4,
//   tiles x 16]): column j of chunk c is one 16-lane vector of the tile's rows, a single store,
//   and x @ out is the layer's product; about copy speed.
// - panel_weights / panel_tokens (AVX512_BF16): a pair of tiles as bf16 pairs in a
//   cache-resident panel, converted once per step, then every token block's dot products.
#pragma once

#include <type_traits>

#include "cpu_common.h"
#include "quant_tiles.h"

namespace splitserve::quant {

// One tile: `w` its chunks, `sc`/`of` its [groups][16] scales and offsets (of: nullptr), `o` its
// first output column, `ld` elements from one output row to the next. The portable version.
template <class D, class S>
void dequantize_tile_generic(const uint8_t* w, int64_t bits, const S* sc, const S* of,
                             const int32_t* bounds, int64_t groups, typename D::T* o, int64_t ld) {
  const int64_t chunk = bits == 8 ? 64 : 32;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = bounds[g]; c < bounds[g + 1]; ++c)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t i = 0; i < TILE; ++i) {
          const uint8_t* wc = w + c * chunk;
          const uint8_t b = wc[2 * i + (j & 1)];
          const float q = bits == 8 ? float(int8_t(wc[32 * (j >> 1) + 2 * i + (j & 1)]))
                                    : float(j < 2 ? (b & 15) : (b >> 4));
          const float offset = of ? float(of[g * TILE + i]) : 0.0f;
          o[(4 * c + j) * ld + i] = D::store(float(sc[g * TILE + i]) * q + offset);
        }
}

#ifdef SPLITSERVE_QUANT_AVX512
// The 4 columns of a chunk as float32, lane i = row i: int8 "pairs" hold row i's columns
// 2p, 2p + 1 in the two bytes of 16-bit word i of half p; int4 holds row i's columns 0, 2, 1, 3
// in the nibbles of its 16-bit word (low to high).
template <int BITS>
inline void chunk_columns(const uint8_t* wc, __m512 (&q)[4]) {
  if constexpr (BITS == 8) {
    for (int p = 0; p < 2; ++p) {
      const __m512i d = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32 * p)));
      q[2 * p] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 24), 24));
      q[2 * p + 1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(d, 16), 24));
    }
  } else {
    const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc)));
    const __m512i nibble = _mm512_set1_epi32(15);
    constexpr int shift[4] = {0, 8, 4, 12};
    for (int j = 0; j < 4; ++j)
      q[j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(d, shift[j]), nibble));
  }
}

// 16 float32 lanes stored as D (bf16: rounded to nearest even as BF16::store, NaN aside).
template <class D>
inline void store16(typename D::T* o, __m512 v) {
  if constexpr (std::is_same_v<D, F32>) {
    _mm512_storeu_ps(o, v);
  } else if constexpr (std::is_same_v<D, BF16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The AVX-512 version of dequantize_tile_generic, for `nt` neighbouring tiles at once (each
// output row then gets nt x 16 contiguous values in one go: rows far apart in memory, written
// one column at a time, would evict each other's lines before they fill).
template <int BITS, class D, class S>
void dequantize_tiles_avx512(const uint8_t* w, int64_t tile_bytes, const S* sc, const S* of,
                             int64_t scale_stride, const int32_t* bounds, int64_t groups,
                             int64_t nt, typename D::T* o, int64_t ld) {
  constexpr int64_t chunk = BITS == 8 ? 64 : 32;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = bounds[g]; c < bounds[g + 1]; ++c)
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t idx = t * scale_stride + g * TILE;
        const __m512 s = load_scales<S>(sc, idx);
        const __m512 offset = of ? load_scales<S>(of, idx) : _mm512_setzero_ps();
        __m512 q[4];
        chunk_columns<BITS>(w + t * tile_bytes + c * chunk, q);
        for (int j = 0; j < 4; ++j)
          store16<D>(o + (4 * c + j) * ld + t * TILE, _mm512_fmadd_ps(q[j], s, offset));
      }
}

#ifdef __AVX512BF16__
// nt tiles as bf16 pairs for the dot products of many tokens, converted once per step instead
// of once per block of 8 tokens: panel[(t * chunks * 2 + 2c + p) * 16 + i] = row i's columns
// 4c + 2p, 4c + 2p + 1, either the integers q (exact: |q| <= 128 has 8 significant bits; the
// scales come after the sums) or, `is_scaled`, scale * q + offset rounded to bf16 (as the
// weight a bf16 matmul takes: no per-group work left per token).
template <int BITS, class S>
void panel_weights(const TileArgs& a, int64_t nt, int64_t chunks, bool is_scaled, uint32_t* panel) {
  constexpr int64_t chunk = BITS == 8 ? 64 : 32;
  const __m512i round = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const int64_t idx = t * a.scale_stride + g * TILE;
      const __m512 s = is_scaled ? load_scales<S>(a.scales, idx) : _mm512_set1_ps(1.0f);
      const bool has_offset = is_scaled && a.offsets;
      const __m512 offset = has_offset ? load_scales<S>(a.offsets, idx) : _mm512_setzero_ps();
      for (int64_t c = a.bounds[g]; c < a.bounds[g + 1]; ++c) {
        __m512 q[4];
        chunk_columns<BITS>(a.weight + t * a.tile_bytes + c * chunk, q);
        __m512i r[4];  // rounded to nearest even in the high 16 bits (BF16::store, NaN aside)
        for (int j = 0; j < 4; ++j) {
          const __m512i u = _mm512_castps_si512(_mm512_fmadd_ps(q[j], s, offset));
          r[j] = _mm512_add_epi32(_mm512_add_epi32(u, round),
                                  _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        }
        for (int p = 0; p < 2; ++p)
          _mm512_storeu_si512(panel + ((t * chunks + c) * 2 + p) * TILE,
                              _mm512_or_si512(_mm512_srli_epi32(r[2 * p], 16),
                                              _mm512_and_si512(r[2 * p + 1], high)));
      }
    }
}

// out[t * MB + m]: the panel's NT tiles against MB tokens (a.x: bf16 pairs); integer panels
// group by group with the tiles' scales and offsets (close_group, as tile_int8_bf16 and
// tile_int4_bf16 sum), scaled ones in one run.
template <int NT, int MB, class S>
void panel_tokens(const uint32_t* panel, int64_t pairs, const TileArgs& a, bool is_scaled,
                  float (*out)[TILE]) {
  const auto* x = static_cast<const uint32_t*>(a.x);
  zero_tiles<NT, MB>(out);
  for (int64_t g = 0; g < (is_scaled ? 1 : a.num_groups); ++g) {
    __m512 acc[NT][MB];
    zero_acc(acc);
    const int64_t k1 = is_scaled ? pairs : 2 * a.bounds[g + 1];
    for (int64_t k = is_scaled ? 0 : 2 * a.bounds[g]; k < k1; ++k) {
      __m512bh w[NT];
      for (int t = 0; t < NT; ++t)
        w[t] = (__m512bh)_mm512_loadu_si512(panel + (t * pairs + k) * TILE);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int32_t(x[m * a.x_stride + k]));
        for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_dpbf16_ps(acc[t][m], w[t], xv);
      }
    }
    if (!is_scaled) {
      close_group<NT, MB, S>(a, g, acc, out, 0.0f);
      continue;
    }
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out[t * MB + m], acc[t][m]);
  }
}
#endif
#endif

// Tiles [0, nt) of a weight (tile_bytes, scale_stride: from one tile to the next).
template <class D, class S>
void dequantize_tiles(const uint8_t* w, int64_t bits, int64_t tile_bytes, const S* sc, const S* of,
                      int64_t scale_stride, const int32_t* bounds, int64_t groups, int64_t nt,
                      typename D::T* o, int64_t ld) {
#ifdef SPLITSERVE_QUANT_AVX512
  (bits == 8 ? dequantize_tiles_avx512<8, D, S> : dequantize_tiles_avx512<4, D, S>)(
      w, tile_bytes, sc, of, scale_stride, bounds, groups, nt, o, ld);
#else
  for (int64_t t = 0; t < nt; ++t)
    dequantize_tile_generic<D, S>(w + t * tile_bytes, bits, sc + t * scale_stride,
                                  of ? of + t * scale_stride : nullptr, bounds, groups,
                                  o + t * TILE, ld);
#endif
}

}  // namespace splitserve::quant
