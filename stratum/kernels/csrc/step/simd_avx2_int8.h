// AVX2's int8 path (QuantRows with qmax 127): vpmaddubsw multiplies a tile-block's unsigned q as bytes
// by the inputs as signed bytes, 32 products per instruction where the int16 path's vpmaddwd takes 16
// and its q must first be unpacked to words. Products are summed in int16 while they cannot overflow
// (|x| <= 127: sixteen products of a 4-bit q, eight of a 5-bit one, four of a 6-bit one), then into
// int32 by vpmaddwd with ones. The sums are the exact integers the int16 path computes from the same
// inputs, and their scaling is tile_dot's, in its order: every family gives the same bits.
#pragma once

namespace stratum_step {

constexpr bool kDot8 = true;
constexpr int kSpan8[3] = {16, 8, 4};  // products an int16 lane may sum, by a format's high_bits

// The q of group g (inputs 8g .. 8g+7) of a tile-block wb for the rows of `part`, as bytes: lo the low
// nibbles' inputs, hi the high ones', each with its high-plane bits (formats.h draws the layout). A row
// quad's 16 bytes hold inputs (0, 1) of its four rows, then (2, 3) (hi: 4 .. 7).
template <Format kF>
STRATUM_INLINE void group_bytes(const uint8_t* wb, int g, int part, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + part * 32));
  lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  if constexpr (high_bits(kF) > 0) {
    constexpr int64_t kPlane = kTile * kBlock / 2;
    __m256i hl, hh;
    if constexpr (high_bits(kF) == 1) {
      Simd::high1(wb + kPlane + g * 16, part, hl, hh);
    } else {
      Simd::high2(wb + kPlane + g * 32, part, hl, hh);
    }
    lo = _mm256_or_si256(lo, hl), hi = _mm256_or_si256(hi, hh);
  }
}

// A row quad's int16 lanes (rows 0-3 of pair slot 0, then of slot 1) reordered so each row's two slots
// sit side by side, for vpmaddwd with ones to add them.
inline __m256i row_order() {
  return _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
}

// One row of one tile, read as stored: the inputs laid out to match group_bytes (x_lo: x0 x1 four times,
// x2 x3 four times; x_hi the same for 4 .. 7), so each int16 lane holds one row's sum of a pair slot.
template <Format kF>
void tile_dot8(const uint8_t* w, const void* scales, int64_t blocks, const QuantRows& x, int64_t row, float* out, int64_t valid) {
  static_assert(is_4bit(kF), "bytes of q: the nibble-plane formats");
  constexpr int kSpan = kSpan8[high_bits(kF)] / 4;  // groups summed in int16
  const ScaleType<kF>* sc = static_cast<const ScaleType<kF>*>(scales);
  const int8_t* x8 = x.q8.data() + row * x.k;
  const float *xd = x.d.data() + row * x.blocks, *xs = x.s.data() + row * x.blocks;
  const int32_t* xh = x.h.data() + row * 2 * x.blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pick_lo = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3);
  const __m256i pick_hi = _mm256_add_epi8(pick_lo, _mm256_set1_epi8(4));
  const __m256i by_row = row_order();
  constexpr int64_t kScaleAhead = kPrefetch * block_scales(kF) * static_cast<int64_t>(sizeof(ScaleType<kF>)) / block_bytes(kF);
  __m256 f[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(kF);
    prefetch(reinterpret_cast<const char*>(sc + b * block_scales(kF)) + kScaleAhead);
    __m256i lo_sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, hi_sum[2] = {lo_sum[0], lo_sum[1]};
    __m256i acc[2] = {lo_sum[0], lo_sum[1]};
    for (int g = 0; g < 4; ++g) {
      prefetch_group<kF>(wb, g);
      int64_t xg8;
      std::memcpy(&xg8, x8 + b * kBlock + g * 8, 8);
      const __m256i xg = _mm256_set1_epi64x(xg8);
      const __m256i xl = _mm256_shuffle_epi8(xg, pick_lo), xh = _mm256_shuffle_epi8(xg, pick_hi);
      for (int part = 0; part < 2; ++part) {
        __m256i lo, hi;
        group_bytes<kF>(wb, g, part, lo, hi);
        acc[part] = _mm256_add_epi16(acc[part], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
      }
      if ((g + 1) % kSpan == 0)
        for (int part = 0; part < 2; ++part) {
          __m256i& sum = g < 2 ? lo_sum[part] : hi_sum[part];
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_shuffle_epi8(acc[part], by_row), ones));
          acc[part] = _mm256_setzero_si256();
        }
    }
    const __m256 dx = _mm256_set1_ps(xd[b]);
    for (int part = 0; part < 2; ++part) {
      __m256 s0, s1;
      part_scales<Simd, kF>(sc, b, part, s0, s1);
      if constexpr (rule(kF) == kSplit) {  // kQ6K: q - 32, so 32 times each half's input sum comes off
        const __m256i c0 = _mm256_set1_epi32(32 * xh[2 * b]), c1 = _mm256_set1_epi32(32 * xh[2 * b + 1]);
        f[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo_sum[part], c0)), _mm256_mul_ps(s0, dx), f[part]);
        f[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi_sum[part], c1)), _mm256_mul_ps(s1, dx), f[part]);
      } else {
        f[part] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo_sum[part], hi_sum[part])), _mm256_mul_ps(s0, dx), f[part]);
        if constexpr (rule(kF) == kDM) f[part] = _mm256_fmadd_ps(s1, _mm256_set1_ps(xs[b]), f[part]);
      }
    }
  }
  for (int part = 0; part < 2; ++part)
    if (valid > part * 8) Simd::store(out + part * 8, f[part], valid - part * 8);
}

// Several rows: the tile's q widened once to bytes [block][quad j: inputs 4j .. 4j+3][lanes 0-7, 8-15],
// four bytes per lane, so vpmaddubsw against one row's quad of inputs (a broadcast int32) leaves each
// lane's two pair sums side by side, and vpmaddwd with ones adds them into its int32 lane.
template <Format kF>
void widen_tile8(const uint8_t* w, int64_t blocks, __m256i* buf) {
  const __m256i by_row = row_order();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(kF);
    __m256i* bb = buf + b * 16;
    for (int64_t line = 0; line < block_bytes(kF); line += 64) prefetch(wb + line + kPrefetch);
    for (int g = 0; g < 4; ++g)
      for (int part = 0; part < 2; ++part) {
        __m256i lo, hi;
        group_bytes<kF>(wb, g, part, lo, hi);
        _mm256_storeu_si256(bb + (2 * g) * 2 + part, _mm256_shuffle_epi8(lo, by_row));
        _mm256_storeu_si256(bb + (2 * g + 1) * 2 + part, _mm256_shuffle_epi8(hi, by_row));
      }
  }
}

// Quads j0 .. j1 - 1 of a widened block (bb) for R rows (x: row r's inputs of the block at x + r * k),
// added into the int32 sums a[r][half]. kPin keeps each int16 sum a chain in one register: over a
// 4-bit format's eight quads GCC 12 otherwise reassociated the adds into a tree, computing every
// product first and spilling them to the stack (41 stack accesses in a pass of two rows), ~15% of a
// Q4_K tile's time at 16-64 rows (scripts/perf/linear_bench.cpp, one core). Over the two or four quads of
// a 5- or 6-bit format the pin made GCC keep the loop rolled, twice as slow: there it is left off.
template <int R, bool kPin>
STRATUM_INLINE void quad_sums8(const __m256i* bb, const int8_t* x, int64_t k, int j0, int j1, __m256i a[R][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int j = j0; j < j1; ++j) {
    __m256i w0 = _mm256_loadu_si256(bb + 2 * j), w1 = _mm256_loadu_si256(bb + 2 * j + 1);
    __asm__("" : "+x"(w0), "+x"(w1));  // loaded once, not once per row
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(quad_of(x + r * k + 4 * j));
      acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xv));
      acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xv));
      if constexpr (kPin) __asm__("" : "+x"(acc[r][0]), "+x"(acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(acc[r][h], ones));
}

// The bytes and scales that follow a widened chunk of a tile (wide_rows8: its next chunk, or the next
// tile's first) fetched while the chunk's passes run: the passes read only the widened copy, so the
// memory sat idle and the next widening and scales waited on it (at 16 rows their loads held ~16% of
// a 1 B decode step's samples). Each pass fetches its share of those lines, a few at each of its
// blocks. Measured on the 1 B file, steps alternating with and without it in one process (Zen 3): a
// decode step of 4 / 8 / 16 / 32 rows 0.90 / 0.94 / 0.965 / 0.994 of the time with the bytes alone,
// the scales too 0.996 / - / 0.984-0.989 / 0.996 of that. (The int16 path's wider passes gained
// nothing from the bytes: 1.00-1.02.)
struct Lines {
  const char* at = nullptr;    // the share's first line
  int64_t per = 0, count = 0;  // lines fetched at each block; lines in the share

  // The share of pass `pass` of `passes` over `blocks` blocks stored in `bytes` at `at`: of the same
  // number of bytes right after them (past a segment's last tile, whatever is there: a prefetch never
  // faults).
  static Lines share(const void* at, int64_t bytes, int64_t blocks, int64_t passes, int64_t pass) {
    const int64_t lines = (bytes + 63) / 64, per = (lines + passes * blocks - 1) / (passes * blocks), first = pass * per * blocks;
    return {static_cast<const char*>(at) + bytes + first * 64, per, std::clamp<int64_t>(lines - first, 0, per * blocks)};
  }
  STRATUM_INLINE void fetch(int64_t b) const {
    for (int64_t i = b * per; i < std::min(count, (b + 1) * per); ++i) __builtin_prefetch(at + i * 64, 0, 2);
  }
};

struct Ahead {
  Lines bytes, scales;
  STRATUM_INLINE void fetch(int64_t b) const { bytes.fetch(b), scales.fetch(b); }
};

// R rows of blocks b0 .. b1 - 1 of one tile from their widened bytes (buf), their scales read from
// `made` (tile_scales) where given; each lane's sums and float operations as tile_dot's, from the sums
// in acc (R rows of 16; from zero at the tile's first block) and back into it; `ahead` fetches this
// pass's share of what follows.
template <int R, Format kF>
void wide_dot8(const __m256i* buf, const void* scales, const float* made, int64_t b0, int64_t b1, const QuantRows& x, int64_t row,
               float* acc, const Ahead& ahead) {
  constexpr int kQuads = kSpan8[high_bits(kF)] / 2;  // quads an int16 lane may sum
  const int64_t k = x.k, nb = x.blocks;
  const int8_t* x8 = x.q8.data() + row * k;
  const float *xd = x.d.data() + row * nb, *xs = x.s.data() + row * nb;
  const int32_t* xh = x.h.data() + row * 2 * nb;
  __m256 f[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) f[r][h] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * kTile + h * 8);
  const auto sums = [&](int64_t b, int j0, int j1, __m256i a[R][2]) {  // quads j0 .. j1 - 1, from zero
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    for (int j = j0; j < j1; j += kQuads) quad_sums8<R, kQuads == 8>(buf + (b - b0) * 16, x8 + b * kBlock, k, j, std::min(j + kQuads, j1), a);
  };
  for (int64_t b = b0; b < b1; ++b) {
    ahead.fetch(b - b0);
    __m256 s0[2], s1[2];
    for (int h = 0; h < 2; ++h)
      if (made != nullptr) {
        const float* m = made + (b - b0) * 32;
        s0[h] = _mm256_loadu_ps(m + h * 8), s1[h] = _mm256_loadu_ps(m + 16 + h * 8);
      } else {
        part_scales<Simd, kF>(static_cast<const ScaleType<kF>*>(scales), b, h, s0[h], s1[h]);
      }
    __m256i a[R][2];
    if constexpr (rule(kF) == kSplit) {  // kQ6K: q - 32, so 32 times each half's input sum comes off
      sums(b, 0, 4, a);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
        const __m256i c = _mm256_set1_epi32(32 * xh[2 * (r * nb + b)]);
        for (int h = 0; h < 2; ++h)
          f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[r][h], c)), _mm256_mul_ps(s0[h], dx), f[r][h]);
      }
      sums(b, 4, 8, a);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
        const __m256i c = _mm256_set1_epi32(32 * xh[2 * (r * nb + b) + 1]);
        for (int h = 0; h < 2; ++h)
          f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a[r][h], c)), _mm256_mul_ps(s1[h], dx), f[r][h]);
      }
    } else {
      sums(b, 0, 8, a);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
        for (int h = 0; h < 2; ++h) {
          f[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][h]), _mm256_mul_ps(s0[h], dx), f[r][h]);
          if constexpr (rule(kF) == kDM) f[r][h] = _mm256_fmadd_ps(s1[h], _mm256_set1_ps(xs[r * nb + b]), f[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + r * kTile + h * 8, f[r][h]);
}

// Blocks b0 .. b1 - 1 of a tile's fp32 scales as part_scales gives them, made once for all the passes
// over its rows: per block s0 of lanes 0-7, of 8-15, then s1 of both (32 floats).
template <Format kF>
void tile_scales(const void* scales, int64_t b0, int64_t b1, float* out) {
  const ScaleType<kF>* sc = static_cast<const ScaleType<kF>*>(scales);
  for (int64_t b = b0; b < b1; ++b)
    for (int h = 0; h < 2; ++h) {
      __m256 s0, s1;
      part_scales<Simd, kF>(sc, b, h, s0, s1);
      float* m = out + (b - b0) * 32;
      _mm256_storeu_ps(m + h * 8, s0), _mm256_storeu_ps(m + 16 + h * 8, s1);
    }
}

// `rows` rows (>= kWideMinRows) of one tile of a nibble-plane format with int8 inputs, a chunk of blocks
// at a time: widened to bytes once (and from kMadeScalesRows rows the scales made once too: per pass they
// were ~10% of a 64-row tile's time), then passes of two rows (four rows' int16 and int32 sums would not
// fit the 16 registers), each lane's sums carried from chunk to chunk in block order.
//
// A 4-bit format's chunk is kChunk8 blocks, whose widened bytes, scales and rows' inputs stay in L1
// (8 + 2 + 8 KB at 16 rows) through the passes, where a whole tile's (32-48 KB at a 1-3 B model's
// 2,048-3,072 inputs, 128 KB at 8,192) were read back from L2 by every pass; the 5- and 6-bit formats
// were 2-8% slower chunked and take the whole tile. With the buffers placed as below (kbench, one
// core, best of three, 1 B and 3 B shapes): 16 rows Q4_K 67-70 -> 70-72 GMAC/s, Q6_K
// 57-61 -> 60-63, Q5_K 66 -> 70, Q4_0 66 -> 73; 64 rows 1-3% more, no case slower.
constexpr int64_t kMadeScalesRows = 8;
constexpr int64_t kChunk8 = 16;

template <Format kF>
void wide_rows8(const uint8_t* wt, const void* st, int64_t blocks, const QuantRows& x, int64_t rows, float* o, int64_t ld,
                int64_t valid) {
  const int64_t chunk = high_bits(kF) == 0 ? kChunk8 : blocks, most = std::min(chunk, blocks);
  // One buffer, on a 64-byte line: the widened bytes (512 a block), the made scales (128 a block) and
  // the rows' sums, each kApart bytes past the one before. As three vectors wherever the heap put them,
  // the same code ran 2-8% slower or faster (kbench) with the allocation.
  constexpr int64_t kApart = 128;
  const int64_t made_at = most * kTile * kBlock + kApart, sums_at = made_at + most * 32 * sizeof(float) + kApart;
  thread_local std::vector<uint8_t> arena;
  arena.resize(sums_at + rows * kTile * sizeof(float) + 64);
  uint8_t* line = arena.data() + (-reinterpret_cast<uintptr_t>(arena.data()) & 63);
  __m256i* buf = reinterpret_cast<__m256i*>(line);
  float* made = reinterpret_cast<float*>(line + made_at);
  float* sums = reinterpret_cast<float*>(line + sums_at);
  const bool make = rows >= kMadeScalesRows;
  const int64_t passes = (rows + 1) / 2, block_scale_bytes = block_scales(kF) * scale_size(kF);
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    const int64_t b1 = std::min(blocks, b0 + chunk), n = b1 - b0;
    const uint8_t* w = wt + b0 * block_bytes(kF);
    const char* s = static_cast<const char*>(st) + b0 * block_scale_bytes;
    widen_tile8<kF>(w, n, buf);
    if (make) tile_scales<kF>(st, b0, b1, made);
    int64_t r = 0;
    const auto pass = [&](auto rr) {
      const Ahead ahead{Lines::share(w, n * block_bytes(kF), n, passes, r / 2), Lines::share(s, n * block_scale_bytes, n, passes, r / 2)};
      wide_dot8<decltype(rr)::value, kF>(buf, st, make ? made : nullptr, b0, b1, x, r, sums + r * kTile, ahead);
    };
    for (; r + 2 <= rows; r += 2) pass(std::integral_constant<int, 2>{});
    if (r < rows) pass(std::integral_constant<int, 1>{});
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(o + r * ld, sums + r * kTile, valid * sizeof(float));
}

}  // namespace stratum_step
