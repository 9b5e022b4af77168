// AVX-512 (F + BW, with VNNI where the CPU has it): the whole 16-lane tile in one vector, vpdpwssd (or
// vpmaddwd + vpaddd) per pair of inputs, and the register-blocked attention's 16 slots per instruction.
#pragma once

#include <immintrin.h>

namespace stratum_step {

#if defined(__AVX512VNNI__)
constexpr const char* kSimdPath = "avx512-vnni";
#else
constexpr const char* kSimdPath = "avx512bw";
#endif
constexpr int64_t kWideMinRows = 0;  // 32 registers hold 4 rows' accumulators: tile_dot unpacks once per 4 rows

struct Simd {
  static constexpr int kLanes = 16, kRegs = 32;
  using F = __m512;
  using I = __m512i;
  static I zero() { return _mm512_setzero_si512(); }
  static I dot(I acc, I w, int32_t x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(x)));
#endif
  }
  static void nibbles(const uint8_t* p, I out[4]) {
    const __m512i raw = _mm512_loadu_si512(p), low = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    out[0] = _mm512_unpacklo_epi8(lo, z), out[1] = _mm512_unpackhi_epi8(lo, z);
    out[2] = _mm512_unpacklo_epi8(hi, z), out[3] = _mm512_unpackhi_epi8(hi, z);
  }
  static I widen8(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // a 5-bit group's fifth bits (16 bytes at h) as 0x10 in the bytes of its low and high nibbles:
  // 128-bit lane L holds rows 4L..4L+3, whose bits are bit L and bit 4 + L of each byte
  static void high1(const uint8_t* h, int, I& lo, I& hi) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    const __m512i m = _mm512_set1_epi8(0x10);
    lo = _mm512_and_si512(_mm512_sllv_epi64(b, _mm512_set_epi64(1, 1, 2, 2, 3, 3, 4, 4)), m);
    hi = _mm512_and_si512(_mm512_srlv_epi64(b, _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0)), m);
  }
  // a 6-bit group's top two bits (32 bytes at h: low nibbles', high nibbles') as 0x00..0x30: lane L's at bits 2L, 2L + 1
  static void high2(const uint8_t* h, int, I& lo, I& hi) {
    const __m512i count = _mm512_set_epi64(0, 0, 2, 2, 4, 4, 6, 6), m = _mm512_set1_epi8(static_cast<char>(0xC0));
    const auto top = [&](const uint8_t* p) {  // to bits 6-7 of each byte, then 4-5
      const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_srli_epi16(_mm512_and_si512(_mm512_sllv_epi64(b, count), m), 2);
    };
    lo = top(h), hi = top(h + 16);
  }
  static void nibbles_with(const uint8_t* p, I hlo, I hhi, I out[4]) {  // nibbles, each or-ed with its high bits
    const __m512i raw = _mm512_loadu_si512(p), low = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, low), hlo);
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), hhi);
    out[0] = _mm512_unpacklo_epi8(lo, z), out[1] = _mm512_unpackhi_epi8(lo, z);
    out[2] = _mm512_unpacklo_epi8(hi, z), out[3] = _mm512_unpackhi_epi8(hi, z);
  }
  static I sub16(I a, int16_t v) { return _mm512_sub_epi16(a, _mm512_set1_epi16(v)); }
  static F bytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F sbytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) {  // 16-bit floats of L rows
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))
                : fp16(p);
  }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static F to_f(I a) { return _mm512_cvtepi32_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void store(float* out, F v, int64_t valid) {
    _mm512_mask_storeu_ps(out, valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1), v);
  }
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BF16* p) {  // bf16 is the top half of an fp32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Scores of G query heads (d floats each, contiguous) against one block of 16 slots of one KV head,
// whose keys lie transposed ([d][16]): sixteen scores per instruction, no horizontal sums.
template <typename T, int G>
inline void block_scores(const float* q, int64_t d, const T* kt, float scale, float* sc) {
  __m512 a[G];
  for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 kv = load16(kt + i * 16);
    for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * d + i]), kv, a[g]);
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(sc + g * 16, _mm512_mul_ps(a[g], _mm512_set1_ps(scale)));
}

// block_scores for R rows reading the same block, row r's G heads at q + r * q_stride and its scores at
// sc + r * sc_stride: R x G accumulators (a row's G alone wait on the fma latency), each lane's chain
// over i the one block_scores runs.
template <typename T, int G, int R>
inline void rows_scores(const float* q, int64_t q_stride, int64_t d, const T* kt, float scale, float* sc, int64_t sc_stride) {
  __m512 a[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) a[r][g] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 kv = load16(kt + i * 16);
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) a[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * q_stride + g * d + i]), kv, a[r][g]);
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(sc + r * sc_stride + g * 16, _mm512_mul_ps(a[r][g], sv));
}

// Keeps a loaded vector in a register: GCC otherwise folds the load into every fma that uses it (G
// loads of each value vector), and the load port, not the fma, sets the pace.
inline void in_register(__m512& v) { __asm__("" : "+v"(v)); }

// acc[g] += sum_t p[g][t] * v[t] for G heads sharing the KV head, the accumulators held in registers:
// C 16-lane columns per head, walked kW at a time so G x kW accumulators and kW values fit the 32
// registers (head size 128 at 3 or 4 heads in two halves); each lane's fma chain over t is unchanged.
template <typename T, int C, int G>
inline void block_values(const float* p, const T* v, int64_t stride, int64_t n, float* acc, int64_t bs) {
  constexpr int kW = G * C + C <= 28 ? C : C / 2;
  for (int c0 = 0; c0 < C; c0 += kW) {
    __m512 a[G][kW];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kW; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * C + c0 + c) * 16);
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[kW];
      for (int c = 0; c < kW; ++c) {
        vv[c] = load16(v + t * stride + 16 * (c0 + c));
        in_register(vv[c]);
      }
      for (int c = 0; c < kW; ++c)
        for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * bs + t]), vv[c], a[g][c]);
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kW; ++c) _mm512_storeu_ps(acc + (g * C + c0 + c) * 16, a[g][c]);
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

constexpr int64_t kScoreRows = 4;  // 4 rows x 4 heads: 16 of the 32 registers

template <typename T>
RowsScoresFn<T> rows_scores_kernel(int64_t block_size, int64_t group) {
  if (block_size != 16) return nullptr;
  switch (group) {
    case 1: return rows_scores<T, 1, kScoreRows>;
    case 2: return rows_scores<T, 2, kScoreRows>;
    case 3: return rows_scores<T, 3, kScoreRows>;
    case 4: return rows_scores<T, 4, kScoreRows>;
    default: return nullptr;
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

#include "simd_avx512_int8.h"
