// AVX2 (with FMA and F16C; AVX-VNNI's 256-bit vpdpwssd where the CPU has it): the 16-lane tile in two
// passes of 8 lanes; from 4 rows up, each tile's weights widened to int16 once for all of them; the
// register-blocked attention in two 8-lane halves.
#pragma once

#include <immintrin.h>

namespace stratum_step {

#if defined(__AVXVNNI__)
constexpr const char* kSimdPath = "avx-vnni";
#else
constexpr const char* kSimdPath = "avx2";
#endif

struct Simd {
  static constexpr int kLanes = 8, kRegs = 16;
  using F = __m256;
  using I = __m256i;
  static I zero() { return _mm256_setzero_si256(); }
  static I dot(I acc, I w, int32_t x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, _mm256_set1_epi32(x));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(x)));
#endif
  }
  static void nibbles(const uint8_t* p, I out[4]) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low = _mm256_set1_epi8(0x0F);
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    out[0] = _mm256_unpacklo_epi8(lo, z), out[1] = _mm256_unpackhi_epi8(lo, z);
    out[2] = _mm256_unpacklo_epi8(hi, z), out[3] = _mm256_unpackhi_epi8(hi, z);
  }
  static I widen8(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // as the AVX-512 ones (simd_avx512.h), for the part's two 128-bit lanes L = 2 part, 2 part + 1
  static void high1(const uint8_t* h, int part, I& lo, I& hi) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    const __m256i m = _mm256_set1_epi8(0x10);
    const int l = 2 * part;
    lo = _mm256_and_si256(_mm256_sllv_epi64(b, _mm256_set_epi64x(3 - l, 3 - l, 4 - l, 4 - l)), m);
    hi = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(l + 1, l + 1, l, l)), m);
  }
  static void high2(const uint8_t* h, int part, I& lo, I& hi) {
    const int l = 2 * part;
    const __m256i count = _mm256_set_epi64x(4 - 2 * l, 4 - 2 * l, 6 - 2 * l, 6 - 2 * l);
    const __m256i m = _mm256_set1_epi8(static_cast<char>(0xC0));
    const auto top = [&](const uint8_t* p) {
      const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_srli_epi16(_mm256_and_si256(_mm256_sllv_epi64(b, count), m), 2);
    };
    lo = top(h), hi = top(h + 16);
  }
  static void nibbles_with(const uint8_t* p, I hlo, I hhi, I out[4]) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), low = _mm256_set1_epi8(0x0F);
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low), hlo);
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), hhi);
    out[0] = _mm256_unpacklo_epi8(lo, z), out[1] = _mm256_unpackhi_epi8(lo, z);
    out[2] = _mm256_unpacklo_epi8(hi, z), out[3] = _mm256_unpackhi_epi8(hi, z);
  }
  static I sub16(I a, int16_t v) { return _mm256_sub_epi16(a, _mm256_set1_epi16(v)); }
  static F bytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F sbytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) {  // 16-bit floats of L rows
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))
                : fp16(p);
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static F to_f(I a) { return _mm256_cvtepi32_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void store(float* out, F v, int64_t valid) {
    if (valid >= 8) return _mm256_storeu_ps(out, v);
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int64_t i = 0; i < valid; ++i) out[i] = tmp[i];
  }
};

// Several rows at once. tile_dot unpacks each group again for every pass of MR <= 4 rows, and 16
// registers hold no more than that; here the tile's weights are widened to int16 pairs once, into a
// buffer that stays in L1/L2 ([block][pair j: inputs 2j, 2j+1][16 lanes], as group_values gives them),
// and every pass of kWideRows rows reads them from there: the passes are then madd and add alone. Per
// lane the integer block sums are the same exact sums and the float operations the same ones in the
// same order as tile_dot's, so the bits do not change.
constexpr int64_t kWideMinRows = 4;  // below this, widening costs more than the unpacking it saves
constexpr int kWideRows = 4;         // rows per pass: 8 accumulators, 2 weights, a broadcast, 2 products

template <Format kF>
void widen_tile(const uint8_t* w, int64_t blocks, __m256i* buf) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * block_bytes(kF);
    __m256i* bb = buf + b * 32;
    for (int64_t line = 0; line < block_bytes(kF); line += 64) prefetch(wb + line + kPrefetch);
    for (int g = 0; g < 4; ++g)
      for (int part = 0; part < 2; ++part) {
        __m256i p[4];
        group_values<Simd, kF>(wb, g, part, p);
        for (int c = 0; c < 4; ++c) _mm256_storeu_si256(bb + (4 * g + c) * 2 + part, p[c]);
      }
  }
}

// Pairs j0 .. j1 - 1 of a widened block (bb) for four rows (x[r]: row r's pairs of the block), into a.
// Named accumulators and the weights pinned in registers: with arrays, GCC 12 copied every sum to
// another register at each pair and folded the weights' loads into each madd (12 vector loads a pair,
// of which Zen 3 issues two a cycle), 34 instructions and ~7.5 cycles a pair by llvm-mca for znver3,
// against 26 and ~4.3 here (the bound: 8 madd and 8 add on the four vector pipes).
__attribute__((noinline)) inline void sums4(const __m256i* bb, const int32_t* const x[4], int j0, int j1, __m256i a[4][2]) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  for (int j = j0; j < j1; ++j) {
    __m256i w0 = _mm256_loadu_si256(bb + 2 * j), w1 = _mm256_loadu_si256(bb + 2 * j + 1);
    __asm__("" : "+x"(w0), "+x"(w1));  // loaded once, not once per row
    a00 = Simd::dot(a00, w0, x[0][j]), a01 = Simd::dot(a01, w1, x[0][j]);
    a10 = Simd::dot(a10, w0, x[1][j]), a11 = Simd::dot(a11, w1, x[1][j]);
    a20 = Simd::dot(a20, w0, x[2][j]), a21 = Simd::dot(a21, w1, x[2][j]);
    a30 = Simd::dot(a30, w0, x[3][j]), a31 = Simd::dot(a31, w1, x[3][j]);
  }
  a[0][0] = a00, a[0][1] = a01, a[1][0] = a10, a[1][1] = a11, a[2][0] = a20, a[2][1] = a21, a[3][0] = a30, a[3][1] = a31;
}

// MR rows of one tile from its widened weights; as tile_dot, with both 8-lane parts in one pass.
template <int MR, Format kF>
void wide_dot(const __m256i* buf, const void* scales, int64_t blocks, const int16_t* xq, const float* xd, const float* xs,
              int64_t k, int64_t nb, float* out, int64_t ld, int64_t valid) {
  const ScaleType<kF>* sc = static_cast<const ScaleType<kF>*>(scales);
  alignas(32) float f[MR][kTile] = {};
  __m256i a[MR][2];
  auto sums = [&](int64_t b, int j0, int j1) {  // pairs j0 .. j1 - 1 of block b into a (zeroed first)
    const __m256i* bb = buf + b * 32;
    if constexpr (MR == 4) {
      const int32_t* x[4];
      for (int r = 0; r < 4; ++r) x[r] = reinterpret_cast<const int32_t*>(xq + r * k + b * kBlock);
      return sums4(bb, x, j0, j1, a);
    }
    for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    for (int j = j0; j < j1; ++j) {
      const __m256i w0 = _mm256_loadu_si256(bb + 2 * j), w1 = _mm256_loadu_si256(bb + 2 * j + 1);
      for (int r = 0; r < MR; ++r) {
        const int32_t xv = reinterpret_cast<const int32_t*>(xq + r * k + b * kBlock)[j];
        a[r][0] = Simd::dot(a[r][0], w0, xv);  // vpdpwssd on AVX-VNNI
        a[r][1] = Simd::dot(a[r][1], w1, xv);
      }
    }
  };
  auto scaled = [&](int64_t b, int part, __m256 d) {  // f += float(a) * (d dx) for every row, in the lanes of `part`
    for (int r = 0; r < MR; ++r) {
      float* fr = f[r] + part * 8;
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
      _mm256_store_ps(fr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][part]), _mm256_mul_ps(d, dx), _mm256_load_ps(fr)));
    }
  };
  auto offset = [&](int64_t b, int part, __m256 m) {  // f += m sx for every row, in the lanes of `part`
    for (int r = 0; r < MR; ++r) {
      float* fr = f[r] + part * 8;
      _mm256_store_ps(fr, _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), _mm256_load_ps(fr)));
    }
  };
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (rule(kF) == kSplit) {  // a scale per 16 inputs: d_lo, then d_hi
      __m256 lo[2], hi[2];
      for (int part = 0; part < 2; ++part) part_scales<Simd, kF>(sc, b, part, lo[part], hi[part]);
      sums(b, 0, 8);
      for (int part = 0; part < 2; ++part) scaled(b, part, lo[part]);
      sums(b, 8, 16);
      for (int part = 0; part < 2; ++part) scaled(b, part, hi[part]);
    } else {  // kD, kDM: d [and m]
      sums(b, 0, 16);
      for (int part = 0; part < 2; ++part) {
        __m256 d, m;
        part_scales<Simd, kF>(sc, b, part, d, m);
        scaled(b, part, d);
        if constexpr (rule(kF) == kDM) offset(b, part, m);
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * ld, f[r], valid * sizeof(float));
}

// `rows` rows (>= kWideMinRows) of one tile: widened into a per-thread buffer, then passes of kWideRows.
template <Format kF>
void wide_rows(const uint8_t* wt, const void* st, int64_t blocks, const QuantRows& x, int64_t rows, float* o, int64_t ld,
               int64_t valid) {
  static_assert(!is_float(kF), "16-bit float weights are not widened");
  thread_local std::vector<int16_t> widened;  // 512 int16 per block
  widened.resize(blocks * kTile * kBlock);
  __m256i* buf = reinterpret_cast<__m256i*>(widened.data());
  widen_tile<kF>(wt, blocks, buf);
  int64_t r = 0;
  const auto pass = [&](auto mr) {
    wide_dot<decltype(mr)::value, kF>(buf, st, blocks, x.q.data() + r * x.k, x.d.data() + r * x.blocks,
                                      x.s.data() + r * x.blocks, x.k, x.blocks, o + r * ld, ld, valid);
  };
  for (; r + kWideRows <= rows; r += kWideRows) pass(std::integral_constant<int, kWideRows>{});
  switch (rows - r) {
    case 3: return pass(std::integral_constant<int, 3>{});
    case 2: return pass(std::integral_constant<int, 2>{});
    case 1: return pass(std::integral_constant<int, 1>{});
    default: return;
  }
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) {  // bf16 is the top half of an fp32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Keeps loaded vectors in registers: GCC otherwise folds the load into every fma that uses it, and
// the load ports, not the fma ones, set the pace.
inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }
inline void in_register(__m256& a, __m256& b) { __asm__("" : "+x"(a), "+x"(b)); }

// block_scores of the AVX-512 path in two 8-lane halves: each lane's fma chain over i, then the
// scale, as there and in the plain loops, so the same bits.
template <typename T, int G>
inline void block_scores(const float* q, int64_t d, const T* kt, float scale, float* sc) {
  __m256 a[G][2];
  for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 k0 = load8(kt + i * 16), k1 = load8(kt + i * 16 + 8);
    in_register(k0, k1);
    for (int g = 0; g < G; ++g) {
      const __m256 qi = _mm256_set1_ps(q[g * d + i]);
      a[g][0] = _mm256_fmadd_ps(qi, k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(qi, k1, a[g][1]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(sc + g * 16, _mm256_mul_ps(a[g][0], sv));
    _mm256_storeu_ps(sc + g * 16 + 8, _mm256_mul_ps(a[g][1], sv));
  }
}

// rows_scores of the AVX-512 path in two 8-lane halves, for R rows of G heads (R x G x 2 accumulators
// and the two key halves within the sixteen registers).
template <typename T, int G, int R>
inline void rows_scores(const float* q, int64_t q_stride, int64_t d, const T* kt, float scale, float* sc, int64_t sc_stride) {
  __m256 a[R][G][2];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) a[r][g][0] = a[r][g][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 k0 = load8(kt + i * 16), k1 = load8(kt + i * 16 + 8);
    in_register(k0, k1);
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
        const __m256 qi = _mm256_set1_ps(q[r * q_stride + g * d + i]);
        a[r][g][0] = _mm256_fmadd_ps(qi, k0, a[r][g][0]);
        a[r][g][1] = _mm256_fmadd_ps(qi, k1, a[r][g][1]);
      }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(sc + r * sc_stride + g * 16, _mm256_mul_ps(a[r][g][0], sv));
      _mm256_storeu_ps(sc + r * sc_stride + g * 16 + 8, _mm256_mul_ps(a[r][g][1], sv));
    }
}

// block_values of the AVX-512 path: C 16-lane columns per head, walked kW 8-lane columns at a time so
// the G x kW accumulators stay in the sixteen registers (G = 4 by 4 columns spilled them to the stack: a
// decode's attention at 1,000 tokens 7.5 -> 6.5 ms a step on the 1 B shape, measured); each lane's fma
// chain over t is unchanged.
template <typename T, int C, int G>
inline void block_values(const float* p, const T* v, int64_t stride, int64_t n, float* acc, int64_t bs) {
  static_assert(C % 2 == 0, "columns are walked in pairs of 16 lanes");
  constexpr int kW = G >= 3 ? 2 : 4;
  for (int c0 = 0; c0 < 2 * C; c0 += kW) {
    __m256 a[G][kW];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kW; ++c) a[g][c] = _mm256_loadu_ps(acc + g * C * 16 + (c0 + c) * 8);
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < kW; ++c) {
        __m256 vv = load8(v + t * stride + (c0 + c) * 8);
        in_register(vv);
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * bs + t]), vv, a[g][c]);
      }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kW; ++c) _mm256_storeu_ps(acc + g * C * 16 + (c0 + c) * 8, a[g][c]);
  }
}

// The register-blocked forms for the shapes they cover (nullptr: attention.h's plain loops).
template <typename T>
ScoresFn<T> scores_kernel(int64_t block_size, int64_t group) {
  if (block_size != 16) return nullptr;
  switch (group) {
    case 1: return block_scores<T, 1>;
    case 2: return block_scores<T, 2>;
    case 3: return block_scores<T, 3>;
    case 4: return block_scores<T, 4>;
    default: return nullptr;
  }
}

constexpr int64_t kScoreRows = 2;  // 2 rows x 3 heads x 2 halves: 12 of the 16 registers

template <typename T>
RowsScoresFn<T> rows_scores_kernel(int64_t block_size, int64_t group) {
  if (block_size != 16) return nullptr;
  switch (group) {
    case 1: return rows_scores<T, 1, kScoreRows>;
    case 2: return rows_scores<T, 2, kScoreRows>;
    case 3: return rows_scores<T, 3, kScoreRows>;
    default: return nullptr;  // 4 heads: one row at a time, whose 8 accumulators already overlap
  }
}

template <typename T>
ValuesFn<T> values_kernel(int64_t head_dim, int64_t group) {
  if (head_dim == 64) switch (group) {
      case 1: return block_values<T, 4, 1>;
      case 2: return block_values<T, 4, 2>;
      case 3: return block_values<T, 4, 3>;
      case 4: return block_values<T, 4, 4>;
      default: break;
    }
  if (head_dim == 128) switch (group) {
      case 1: return block_values<T, 8, 1>;
      case 2: return block_values<T, 8, 2>;
      case 3: return block_values<T, 8, 3>;
      case 4: return block_values<T, 8, 4>;
      default: break;
    }
  return nullptr;
}

}  // namespace stratum_step

#include "simd_avx2_int8.h"
