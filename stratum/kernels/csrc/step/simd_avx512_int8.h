// AVX-512's int8 path (QuantRows with qmax 127): a tile-block's unsigned q as bytes against the inputs
// as signed bytes, four products per int32 lane and instruction: vpdpbusd where the CPU has VNNI (as
// llama.cpp's q4_K x q8_K on these CPUs), else vpmaddubsw and vpmaddwd with ones. The int16 path's
// vpdpwssd takes two per lane, after unpacking q to words; here a group's bytes are only reordered so
// that each lane holds four inputs of its own row, and a pass of rows shares that.
//
// The sums are the exact integers the int16 path computes from the same inputs (no product or pair sum
// can overflow: |q| <= 63, |x| <= 127), and their scaling is tile_dot's, in its order: every family
// gives the same bits (tests/test_step_driver.py runs this file under SIMDe's AVX-512 where the CPU
// has none).
#pragma once

namespace stratum_step {

constexpr bool kDot8 = true;

// acc[i] += w[4i] x[0] + ... + w[4i+3] x[3]: w unsigned bytes, x four signed bytes (as int32).
STRATUM_INLINE __m512i dot4(__m512i acc, __m512i w, int32_t x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_set1_epi32(x)), _mm512_set1_epi16(1)));
#endif
}

// The q of group g of a tile-block as bytes, four per row: lo holds inputs 8g .. 8g+3 of row i in lane
// i, hi inputs 8g+4 .. 8g+7 (formats.h's row quad bytes, (0, 1) of four rows then (2, 3), put in row
// order within each 128-bit lane), with the high plane's bits or-ed in.
template <Format kF>
STRATUM_INLINE void group_quads(const uint8_t* wb, int g, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i raw = _mm512_loadu_si512(wb + g * 64);
  lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
  if constexpr (high_bits(kF) > 0) {
    constexpr int64_t kPlane = kTile * kBlock / 2;
    __m512i hl, hh;
    if constexpr (high_bits(kF) == 1) {
      Simd::high1(wb + kPlane + g * 16, 0, hl, hh);
    } else {
      Simd::high2(wb + kPlane + g * 32, 0, hl, hh);
    }
    lo = _mm512_or_si512(lo, hl), hi = _mm512_or_si512(hi, hh);
  }
  const __m512i by_row = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  lo = _mm512_shuffle_epi8(lo, by_row), hi = _mm512_shuffle_epi8(hi, by_row);
}

// R rows (from `row`) of one tile: each group's bytes reordered once for the pass, every lane's block
// sums exact, and each block's scaling tile_dot's, in its order.
template <int R, Format kF>
void rows_dot8(const uint8_t* w, const void* scales, int64_t blocks, const QuantRows& x, int64_t row, float* out, int64_t ld,
               int64_t valid) {
  const ScaleType<kF>* sc = static_cast<const ScaleType<kF>*>(scales);
  const int64_t k = x.k, nb = x.blocks;
  const int8_t* x8 = x.q8.data() + row * k;
  const float *xd = x.d.data() + row * nb, *xs = x.s.data() + row * nb;
  const int32_t* xh = x.h.data() + row * 2 * nb;
  constexpr int64_t kScaleAhead = kPrefetch * block_scales(kF) * static_cast<int64_t>(sizeof(ScaleType<kF>)) / block_bytes(kF);
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(kF);
    prefetch(reinterpret_cast<const char*>(sc + b * block_scales(kF)) + kScaleAhead);
    __m512i a0[R], a1[R];  // kQ6K: inputs 0-15 in a0, 16-31 in a1; otherwise all in a0
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      prefetch_group<kF>(wb, g);
      __m512i lo, hi;
      group_quads<kF>(wb, g, lo, hi);
      for (int r = 0; r < R; ++r) {
        const int8_t* xg = x8 + r * k + b * kBlock + g * 8;
        __m512i& a = rule(kF) == kSplit && g >= 2 ? a1[r] : a0[r];
        a = dot4(dot4(a, lo, quad_of(xg)), hi, quad_of(xg + 4));
      }
    }
    __m512 s0, s1;
    part_scales<Simd, kF>(sc, b, 0, s0, s1);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
      if constexpr (rule(kF) == kSplit) {  // kQ6K: q - 32, so 32 times each half's input sum comes off
        const int32_t* h = xh + 2 * (r * nb + b);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[r], _mm512_set1_epi32(32 * h[0]))), _mm512_mul_ps(s0, dx), f[r]);
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[r], _mm512_set1_epi32(32 * h[1]))), _mm512_mul_ps(s1, dx), f[r]);
      } else {
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[r]), _mm512_mul_ps(s0, dx), f[r]);
        if constexpr (rule(kF) == kDM) f[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(xs[r * nb + b]), f[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) Simd::store(out + r * ld, f[r], valid);
}

template <Format kF>
void tile_dot8(const uint8_t* w, const void* scales, int64_t blocks, const QuantRows& x, int64_t row, float* out, int64_t valid) {
  static_assert(is_4bit(kF), "bytes of q: the nibble-plane formats");
  rows_dot8<1, kF>(w, scales, blocks, x, row, out, kTile, valid);
}

// Every row of one tile (kWideMinRows is 0: projection.h brings all of them here), in passes of four.
template <Format kF>
void wide_rows8(const uint8_t* wt, const void* st, int64_t blocks, const QuantRows& x, int64_t rows, float* o, int64_t ld,
                int64_t valid) {
  static_assert(is_4bit(kF), "bytes of q: the nibble-plane formats");
  passes_of_four(rows, [&](auto rr, int64_t r) {
    rows_dot8<decltype(rr)::value, kF>(wt, st, blocks, x, r, o + r * ld, ld, valid);
  });
}

}  // namespace stratum_step
