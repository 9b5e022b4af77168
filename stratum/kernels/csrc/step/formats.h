// The tile formats: how a packed segment stores its weights, written here (`put_row`, `put_scales`: the
// native repack, csrc/repack.cpp; kernels/packed.py `pack_reference` writes the same bytes in NumPy) and
// read into int16 pairs and fp32 scales for any SIMD family. A new format is one more entry in each list
// of this file; a new way of scaling a block's sums is a `Rule` (projection.h).
#pragma once

#include <type_traits>

#include "numerics.h"

namespace stratum_step {

// Each format is one affine form per block of 32 inputs, weight = q d + m, with the file's integers:
//   kQ4   4-bit q, fp16 d and m per block                                   (Q4_0: m = -8 d; Q4_1)
//   kQ8   int8 q, fp16 d per block                                          (Q8_0)
//   kQ5   5-bit q, fp16 d per block, m = -16 d                              (Q5_0)
//   kQ5M  5-bit q, fp16 d and m per block                                   (Q5_1)
//   kQ4K  4-bit q; 6-bit sc, min per block; fp16 D, Dmin per 256 inputs:
//         d = D sc, m = -Dmin min                                           (Q4_K)
//   kQ5K  5-bit q, scales as kQ4K                                           (Q5_K)
//   kQ6K  6-bit q, centred (q - 32); int8 sc_lo (inputs 0-15), sc_hi (16-31) per block; fp16 D per
//         256: d_lo = D sc_lo, d_hi = D sc_hi, no m                         (Q6_K)
//   kF16, kBF16  the 16-bit floats themselves, no scales                    (F16, BF16)
// A K-quant block's scale, an fp16 times a 6- or 8-bit integer, is exact in fp32 (not in fp16): kQ4K,
// kQ5K and kQ6K keep the integers and the fp16 and multiply them in fp32 here, which gives that value.
// (3, int8 q with fp32 scales, is retired: no GGUF type has taken it since kQ5K.)
enum Format : int64_t { kQ4 = 0, kQ8 = 1, kQ4K = 2, kF16 = 4, kBF16 = 5, kQ5 = 6, kQ5M = 7, kQ6K = 8, kQ5K = 9 };

constexpr bool is_format(int64_t f) { return f >= kQ4 && f <= kQ5K && f != 3; }
constexpr bool is_float(Format f) { return f == kF16 || f == kBF16; }
constexpr bool is_4bit(Format f) { return !is_float(f) && f != kQ8; }  // a nibble plane
constexpr int high_bits(Format f) { return f == kQ5 || f == kQ5M || f == kQ5K ? 1 : f == kQ6K ? 2 : 0; }  // a plane after it
constexpr bool super_scales(Format f) { return f == kQ4K || f == kQ5K || f == kQ6K; }

// fn(std::integral_constant<Format, f>) for the segment's format: each format's code is compiled once.
template <typename Fn>
inline void with_format(Format f, Fn&& fn) {
  switch (f) {
    case kQ4: return fn(std::integral_constant<Format, kQ4>{});
    case kQ8: return fn(std::integral_constant<Format, kQ8>{});
    case kQ4K: return fn(std::integral_constant<Format, kQ4K>{});
    case kF16: return fn(std::integral_constant<Format, kF16>{});
    case kBF16: return fn(std::integral_constant<Format, kBF16>{});
    case kQ5: return fn(std::integral_constant<Format, kQ5>{});
    case kQ5M: return fn(std::integral_constant<Format, kQ5M>{});
    case kQ6K: return fn(std::integral_constant<Format, kQ6K>{});
    case kQ5K: return fn(std::integral_constant<Format, kQ5K>{});
  }
}

// How a block's exact integer sums become fp32 (projection.h applies it, in this order, per output lane):
//   kDM     f = fma(float(sum q x), d dx, f); f = fma(m, sx, f)
//   kD      f = fma(float(sum q x), d dx, f)
//   kSplit  f = fma(float(sum_{j<16} q x), d_lo dx, f); f = fma(float(sum_{j>=16} q x), d_hi dx, f)
//   kFloat  a0 = fma chain over even inputs, a1 over odd ones (fp32 x, from 0); f = f + (a0 + a1)
enum Rule { kDM, kD, kSplit, kFloat };
constexpr Rule rule(Format f) { return is_float(f) ? kFloat : f == kQ8 ? kD : f == kQ6K ? kSplit : kDM; }

// A tile-block is 16 rows (outputs) by one block of 32 inputs. Its weights, per format:
//
//   4-bit, 256 bytes: four groups g of 8 inputs, 64 bytes each, 16 bytes per row quad L (rows 4L..4L+3);
//   a byte holds two inputs of one row, the low nibble's and, 4 inputs on, the high one's:
//
//        byte   0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15
//        row   4L   4L  4L+1 4L+1 4L+2 4L+2 4L+3 4L+3  4L   4L  4L+1 4L+1 4L+2 4L+2 4L+3 4L+3
//        low    0    1    0    1    0    1    0    1    2    3    2    3    2    3    2    3
//        high   4    5    4    5    4    5    4    5    6    7    6    7    6    7    6    7
//                                                                      (input 8g + the number)
//     +--------- g = 0 ---------+--------- g = 1 ---------+-- g = 2 --+-- g = 3 --+
//     | L=0 | L=1 | L=2 | L=3   | L=0 | L=1 | L=2 | L=3   |    ...    |    ...    |
//     +-------------------------+-------------------------+-----------+-----------+
//   so unpacking a 128-bit lane's bytes gives one pair of inputs per 32-bit lane, for its four rows.
//
//   5-bit, 320 bytes: the 4-bit plane of q & 15, then 16 bytes per group of fifth bits: byte r's bit L
//   is bit 4 of the q in the low nibble of byte 16L + r of the group's 64, bit 4 + L that of its high one.
//
//     | 4-bit plane (256) | g0: 16 | g1: 16 | g2: 16 | g3: 16 |       byte r:  h3 h2 h1 h0 l3 l2 l1 l0
//                                                                          (lL, hL: row quad L's bits)
//
//   6-bit, 384 bytes: the 4-bit plane of q & 15, then 32 bytes per group of q >> 4: bits 2L, 2L + 1 of
//   byte r (r < 16) for the low nibble's q in byte 16L + r, of byte 16 + r for the high nibble's.
//
//     | 4-bit plane (256) | g0: 16 low, 16 high | g1 | g2 | g3 |  byte r:  L3 L3 L2 L2 L1 L1 L0 L0
//
//   8-bit, 512 bytes: 16 pairs p of inputs (2p, 2p + 1), 32 bytes each: int8 q, row by row.
//
//     | p=0: r0 r0 r1 r1 ... r15 r15 | p=1: ... | ... | p=15 |     (r0 r0: row 0's inputs 2p, 2p + 1)
//
//   16-bit float, 1024 bytes: 32 inputs j, 32 bytes each: fp16 / bf16, row by row.
//
//     | j=0: r0 r1 ... r15 | j=1: ... | ... | j=31 |
//
// Its scales, 16 values (one per row) of each of the format's scales in turn:
//
//   kQ4, kQ5M: | d: 16 fp16 | m: 16 fp16 |        kQ5, kQ8: | d: 16 fp16 |        kF16, kBF16: none
//
//   kQ4K, kQ5K, kQ6K: one uint8 row per super-block (8 blocks, 256 inputs), 320 bytes (288 for kQ6K):
//
//     | block 0: sc 16, min 16 | block 1 | ... | block 7 | D: 16 fp16 | Dmin: 16 fp16 |
//                                                         (kQ6K: sc_lo 16, sc_hi 16 int8; D alone)
constexpr int64_t kSuper = 8;  // blocks per super-block
constexpr int64_t super_bytes(Format f) { return kSuper * 2 * kTile + (f == kQ6K ? 1 : 2) * kTile * 2; }
constexpr int64_t block_bytes(Format f) {
  return is_4bit(f) ? kTile * kBlock / 8 * (4 + high_bits(f)) : is_float(f) ? kTile * kBlock * 2 : kTile * kBlock;
}
// values of a tile-block's scales (fp16); for the super-block formats the bytes a block takes on average
constexpr int64_t block_scales(Format f) {
  return super_scales(f) ? super_bytes(f) / kSuper : f == kQ8 || f == kQ5 ? kTile : is_float(f) ? 0 : 2 * kTile;
}
constexpr int64_t scale_size(Format f) { return super_scales(f) ? 1 : 2; }
template <Format kF>
using ScaleType = std::conditional_t<super_scales(kF), uint8_t, uint16_t>;

// One segment of a projection: `rows` outputs in one format. data [tiles, blocks, block_bytes] uint8,
// scales [tiles, blocks, block_scales] fp16, or [tiles, blocks / 8, super_bytes] uint8 (packed_step.cpp
// checks the shapes).
struct Packed {
  const uint8_t* data;
  const void* scales;
  int64_t tiles, blocks, rows;
  Format format;

  int64_t in_features() const { return blocks * kBlock; }
  int64_t bytes_per_tile() const { return blocks * block_bytes(format); }
  int64_t scale_bytes_per_tile() const { return blocks * block_scales(format) * scale_size(format); }
};

// The two scales of block b for the lanes part*L .. part*L + L - 1 of a SIMD family S, in fp32, as
// `Rule` takes them: d and m (kSplit: d_lo and d_hi; kD: d, and s1 zero); the K-quant ones multiplied out.
template <class S, Format kF>
inline void part_scales(const ScaleType<kF>* sc, int64_t b, int part, typename S::F& s0, typename S::F& s1) {
  constexpr int L = S::kLanes;
  if constexpr (super_scales(kF)) {
    const uint8_t* sup = sc + b / kSuper * super_bytes(kF);
    const uint8_t* ints = sup + b % kSuper * 2 * kTile + part * L;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(sup + kSuper * 2 * kTile) + part * L;
    if constexpr (kF != kQ6K) {
      s0 = S::mul(S::fp16(d), S::bytes(ints));
      s1 = S::mul(S::mul(S::fp16(d + kTile), S::set1(-1.f)), S::bytes(ints + kTile));
    } else {
      s0 = S::mul(S::fp16(d), S::sbytes(ints));
      s1 = S::mul(S::fp16(d), S::sbytes(ints + kTile));
    }
  } else {
    const ScaleType<kF>* sb = sc + b * block_scales(kF) + part * L;
    s0 = S::scale(sb);
    if constexpr (kF == kQ5) {
      s1 = S::mul(s0, S::set1(-16.f));
    } else if constexpr (rule(kF) == kD) {
      s1 = S::zerof();
    } else {
      s1 = S::scale(sb + kTile);
    }
  }
}

// The q of group g (inputs 8g .. 8g+7) of an integer tile-block wb, for the lanes of `part`, as four
// int16 pair vectors p[c] = inputs (8g + 2c, 8g + 2c + 1) of each lane's row (kQ6K: centred, q - 32).
template <class S, Format kF>
inline void group_values(const uint8_t* wb, int g, int part, typename S::I p[4]) {
  if constexpr (kF == kQ8) {
    for (int c = 0; c < 4; ++c) p[c] = S::widen8(wb + (4 * g + c) * 32 + part * S::kLanes * 2);
  } else {
    const uint8_t* nib = wb + g * 64 + part * S::kLanes * 4;
    if constexpr (high_bits(kF) == 0) {
      S::nibbles(nib, p);
    } else {
      constexpr int64_t kPlane = kTile * kBlock / 2;  // the high plane follows the 256 bytes of nibbles
      typename S::I lo, hi;
      if constexpr (high_bits(kF) == 1) {
        S::high1(wb + kPlane + g * 16, part, lo, hi);
      } else {
        S::high2(wb + kPlane + g * 32, part, lo, hi);
      }
      S::nibbles_with(nib, lo, hi, p);
      if constexpr (kF == kQ6K)
        for (int c = 0; c < 4; ++c) p[c] = S::sub16(p[c], 32);
    }
  }
}

// Writing a tile-block (csrc/repack.cpp), the drawings above from the other side. Row i's q of one block
// (32 values: 4-, 5- or 6-bit unsigned, or kQ8's int8 bits) into the zeroed integer tile-block wb.
inline void put_row(Format f, int64_t i, const uint8_t* q, uint8_t* wb) {
  if (f == kQ8) {
    for (int64_t j = 0; j < kBlock; ++j) wb[(j / 2) * 2 * kTile + 2 * i + j % 2] = q[j];
    return;
  }
  const int64_t quad = i / 4, k = i % 4;
  uint8_t* high = wb + kTile * kBlock / 2;
  for (int64_t g = 0; g < 4; ++g)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t r = h * 8 + k * 2 + e;  // the byte in the row quad's 16 of group g
        const uint8_t lo = q[8 * g + 2 * h + e], hi = q[8 * g + 4 + 2 * h + e];
        wb[g * 64 + quad * 16 + r] = (lo & 15) | (hi & 15) << 4;
        if (high_bits(f) == 1) {
          high[g * 16 + r] |= (lo >> 4) << quad | (hi >> 4) << (4 + quad);
        } else if (high_bits(f) == 2) {
          high[g * 32 + r] |= (lo >> 4) << (2 * quad);
          high[g * 32 + 16 + r] |= (hi >> 4) << (2 * quad);
        }
      }
}

// Row i's 32 16-bit floats of one block into the float tile-block wb.
inline void put_row_float(int64_t i, const uint16_t* v, uint8_t* wb) {
  for (int64_t j = 0; j < kBlock; ++j) std::memcpy(wb + (j * kTile + i) * 2, v + j, 2);
}

// Row i's scales of block b into its tile's scales sc (zeroed bytes, scale_bytes_per_tile of them):
// the format's fp16 values (d, then m where it has one), or for the super-block formats the block's two
// integer scales (sc and min; sc_lo and sc_hi) and the super-block's fp16 D (and Dmin).
inline void put_scales(Format f, int64_t b, int64_t i, const uint8_t* ints, const uint16_t* fp16, uint8_t* sc) {
  if (!super_scales(f)) {
    for (int64_t s = 0; s < block_scales(f) / kTile; ++s) std::memcpy(sc + ((b * block_scales(f)) + s * kTile + i) * 2, fp16 + s, 2);
    return;
  }
  uint8_t* sup = sc + b / kSuper * super_bytes(f);
  sup[b % kSuper * 2 * kTile + i] = ints[0];
  sup[b % kSuper * 2 * kTile + kTile + i] = ints[1];
  for (int64_t s = 0; s < (f == kQ6K ? 1 : 2); ++s) std::memcpy(sup + kSuper * 2 * kTile + (s * kTile + i) * 2, fp16 + s, 2);
}

// Fetches, kPrefetch ahead, the 64-byte lines of an integer tile-block that group g's turn covers: the
// nibbles' line g and the high plane's, or the 8-bit block's lines g and g + 4.
template <Format kF>
inline void prefetch_group(const uint8_t* wb, int g) {
  for (int64_t line = g * 64; line < block_bytes(kF); line += 256) prefetch(wb + line + kPrefetch);
}

}  // namespace stratum_step
