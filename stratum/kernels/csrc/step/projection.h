// The projections: out = x @ w^T on the packed tiles, 16 outputs side by side, in any tile format and
// SIMD family (one code: formats.h reads a format's blocks, simd.h's family supplies the instructions).
//
// The scheme is llama.cpp's vec_dot_q4_1_q8_1 (ggml-quants.c) at higher precision: each activation row
// is quantized to int16 per block of 32 with one fp32 scale (numerics.h), and a block's dot product is an
// exact integer sum scaled once: for Q4_1,
//     sum_j (q_j d + m) x_j = d dx sum_j q_j xq_j + m dx sum_j xq_j.
// Each int32 lane adds two s16 x s16 products per instruction, for one of the tile's 16 outputs.
#pragma once

#include "simd.h"

namespace stratum_step {

// A projection: its segments' outputs side by side (a fused projection whose parts differ in format).
using Projection = std::vector<Packed>;

inline int64_t out_features(const Projection& w) {
  int64_t n = 0;
  for (const auto& s : w) n += s.rows;
  return n;
}

// A family's widened path for `rows` >= kWideMinRows rows of one tile (simd_avx2.h); declared for all,
// defined and reached only where kWideMinRows > 0.
template <Format kF>
void wide_rows(const uint8_t* wt, const void* st, int64_t blocks, const QuantRows& x, int64_t rows, float* o, int64_t ld,
               int64_t valid);
// A family's int8 paths for a tile of a nibble-plane format (simd_avx2_int8.h, simd_avx512_int8.h),
// reached where kDot8 and the activations are int8: one row at a time, or several from kWideMinRows rows.
template <Format kF>
void tile_dot8(const uint8_t* w, const void* scales, int64_t blocks, const QuantRows& x, int64_t row, float* out, int64_t valid);
template <Format kF>
void wide_rows8(const uint8_t* wt, const void* st, int64_t blocks, const QuantRows& x, int64_t rows, float* o, int64_t ld,
                int64_t valid);

// kFloat: block b's 32 fp32 inputs of MR rows against the part's lanes of 16-bit weights.
template <int MR, Format kF>
STRATUM_INLINE void float_block(const uint8_t* wb, int part, const float* xf, int64_t k, int64_t b, Simd::F f[MR]) {
  using F = Simd::F;
  const uint16_t* wh = reinterpret_cast<const uint16_t*>(wb) + part * Simd::kLanes;  // [input j][row]
  F a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = Simd::zerof();
  for (int j = 0; j < kBlock; j += 2) {
    if (part == 0) prefetch(wb + j * 2 * kTile + kPrefetch);
    const F w0 = Simd::wide(wh + j * kTile, kF == kBF16), w1 = Simd::wide(wh + (j + 1) * kTile, kF == kBF16);
    for (int r = 0; r < MR; ++r) {
      const float* xr = xf + r * k + b * kBlock;
      a0[r] = Simd::fma(w0, Simd::set1(xr[j]), a0[r]);
      a1[r] = Simd::fma(w1, Simd::set1(xr[j + 1]), a1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) f[r] = Simd::add(f[r], Simd::add(a0[r], a1[r]));
}

// The exact integer sums of one block for MR rows (xb: the first row's block, rows k apart), in a0 and
// a1 (kSplit: inputs 0-15 in a0, 16-31 in a1; otherwise split only to hide an accumulator's latency).
template <int MR, Format kF>
STRATUM_INLINE void block_sums(const uint8_t* wb, int part, const int16_t* xb, int64_t k, Simd::I a0[MR], Simd::I a1[MR]) {
  using I = Simd::I;
  constexpr bool kTwo = Simd::kRegs >= 32 || MR <= 2;  // two accumulators per row where registers allow
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = Simd::zero();
  for (int g = 0; g < 4; ++g) {  // inputs 8g .. 8g+7 as four pairs, one pair per int32 lane and output
    if (part == 0) prefetch_group<kF>(wb, g);
    I p[4];
    group_values<Simd, kF>(wb, g, part, p);
    for (int r = 0; r < MR; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xb + r * k + g * 8);  // pairs of int16
      if constexpr (rule(kF) == kSplit) {
        I& a = g < 2 ? a0[r] : a1[r];
        a = Simd::dot(Simd::dot(Simd::dot(Simd::dot(a, p[0], xr[0]), p[1], xr[1]), p[2], xr[2]), p[3], xr[3]);
      } else if constexpr (kTwo) {
        a0[r] = Simd::dot(a0[r], p[0], xr[0]);
        a1[r] = Simd::dot(a1[r], p[1], xr[1]);
        a0[r] = Simd::dot(a0[r], p[2], xr[2]);
        a1[r] = Simd::dot(a1[r], p[3], xr[3]);
      } else {
        a0[r] = Simd::dot(Simd::dot(Simd::dot(Simd::dot(a0[r], p[0], xr[0]), p[1], xr[1]), p[2], xr[2]), p[3], xr[3]);
      }
    }
  }
}

// f += block b's sums scaled by the format's `Rule` (formats.h), for MR rows (xd, xs: their dx, sx).
template <int MR, Format kF>
STRATUM_INLINE void scale_sums(const ScaleType<kF>* sc, int64_t b, int part, const Simd::I a0[MR], const Simd::I a1[MR],
                               const float* xd, const float* xs, int64_t nb, Simd::F f[MR]) {
  Simd::F s0, s1;
  part_scales<Simd, kF>(sc, b, part, s0, s1);
  for (int r = 0; r < MR; ++r) {
    const Simd::F dx = Simd::set1(xd[r * nb + b]);
    if constexpr (rule(kF) == kSplit) {  // s0, s1: d_lo, d_hi
      f[r] = Simd::fma(Simd::to_f(a0[r]), Simd::mul(s0, dx), f[r]);
      f[r] = Simd::fma(Simd::to_f(a1[r]), Simd::mul(s1, dx), f[r]);
    } else {
      f[r] = Simd::fma(Simd::to_f(Simd::iadd(a0[r], a1[r])), Simd::mul(s0, dx), f[r]);
      if constexpr (rule(kF) == kDM) f[r] = Simd::fma(s1, Simd::set1(xs[r * nb + b]), f[r]);
    }
  }
}

// One tile of 16 outputs for MR rows, in weight format kF. w: the tile's blocks; scales: its scales
// (formats.h); xq, xd, xs: the first row's quantized inputs, scales and scaled sums, xf its fp32 inputs
// (rows `k` values and `nb` blocks apart). out: MR rows of `ld` floats, `valid` of 16 written. Each
// output lane adds its blocks in order, by its format's Rule.
template <int MR, Format kF>
inline void tile_dot(const uint8_t* w, const void* scales, int64_t blocks, const int16_t* xq, const float* xd,
                     const float* xs, const float* xf, int64_t k, int64_t nb, float* out, int64_t ld, int64_t valid) {
  using S = ScaleType<kF>;
  const S* sc = static_cast<const S*>(scales);
  constexpr int64_t kScales = block_scales(kF), kBytes = block_bytes(kF);
  constexpr int L = Simd::kLanes;
  constexpr int64_t kScaleAhead = kScales ? kPrefetch * kScales * static_cast<int64_t>(sizeof(S)) / kBytes : 0;
  for (int part = 0; part < kTile / L; ++part) {  // the tile's lanes part*L .. part*L + L - 1
    Simd::F f[MR];
    for (int r = 0; r < MR; ++r) f[r] = Simd::zerof();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * kBytes;
      if constexpr (rule(kF) == kFloat) {
        float_block<MR, kF>(wb, part, xf, k, b, f);
      } else {
        if (part == 0) prefetch(reinterpret_cast<const char*>(sc + b * kScales) + kScaleAhead);
        Simd::I a0[MR], a1[MR];
        block_sums<MR, kF>(wb, part, xq + b * kBlock, k, a0, a1);
        scale_sums<MR, kF>(sc, b, part, a0, a1, xd, xs, nb, f);
      }
    }
    if (valid > part * L)
      for (int r = 0; r < MR; ++r) Simd::store(out + r * ld + part * L, f[r], valid - part * L);
  }
}

// Every row of tile t of segment w: the family's widened path from kWideMinRows rows, else passes of 4.
template <Format kF>
void tile_rows(const Packed& w, int64_t t, const QuantRows& x, int64_t rows, float* out, int64_t ld) {
  const uint8_t* wt = w.data + t * w.bytes_per_tile();
  const void* st = static_cast<const char*>(w.scales) + t * w.scale_bytes_per_tile();
  const int64_t valid = std::min(kTile, w.rows - t * kTile);
  float* o = out + t * kTile;
  if constexpr (kDot8 && is_4bit(kF)) {
    if (x.int8() && rows >= kWideMinRows) return wide_rows8<kF>(wt, st, w.blocks, x, rows, o, ld, valid);
    if (x.int8()) {
      for (int64_t r = 0; r < rows; ++r) tile_dot8<kF>(wt, st, w.blocks, x, r, o + r * ld, valid);
      return;
    }
  }
  if constexpr (kWideMinRows > 0 && !is_float(kF)) {
    if (rows >= kWideMinRows) return wide_rows<kF>(wt, st, w.blocks, x, rows, o, ld, valid);
  }
  passes_of_four(rows, [&](auto mr, int64_t r) {
    tile_dot<decltype(mr)::value, kF>(wt, st, w.blocks, x.q.data() + r * x.k, x.d.data() + r * x.blocks,
                                      x.s.data() + r * x.blocks, x.x + r * x.k, x.k, x.blocks, o + r * ld, ld, valid);
  });
}

// out [rows, out_features(w)] = x @ w^T (x quantized, or fp32 for fp16/bf16 weights); the segments'
// tiles are shared out among the threads together. The caller checks x.k == each segment's in_features().
inline void linear(const Projection& w, const QuantRows& x, int64_t rows, float* out) {
  const int64_t ld = out_features(w);
  std::vector<int64_t> first{0}, column{0};
  for (const auto& s : w) {
    first.push_back(first.back() + s.tiles);
    column.push_back(column.back() + s.rows);
  }
  parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    size_t s = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first[s + 1]) ++s;
      const Packed& seg = w[s];
      with_format(seg.format, [&](auto f) { tile_rows<decltype(f)::value>(seg, t - first[s], x, rows, out + column[s], ld); });
    }
  });
}

}  // namespace stratum_step
