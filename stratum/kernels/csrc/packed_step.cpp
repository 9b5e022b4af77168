// The model's whole forward on the GGUF's packed weights, as one native call per step.
//
// Why: a step in PyTorch is ~600 operator calls (each a few microseconds of dispatch at one decode
// token) and its int4 kernel reads weights at a fraction of the memory bandwidth. Here one call
// runs every layer: RMSNorm, the projections on the packed 4-bit (Q4_0 / Q4_1) or 8-bit (Q8_0)
// blocks, rotary embedding, the write into the paged KV pool, attention read in place, SwiGLU and
// the residual stream, with threads inside and without the Python interpreter.
//
// The projections follow the scheme of llama.cpp's vec_dot_q4_1_q8_1 (ggml-quants.c), at higher
// precision: each activation row is quantized to int16 per block of 32 with one fp32 scale (llama.cpp
// uses int8, which here cost 1.5 points of top-1 agreement with the fp32 model), and a block's dot
// product is an exact integer sum scaled once: for Q4_1,
//     sum_j (q_j d + m) x_j = d dx sum_j q_j xq_j + m dx sum_j xq_j.
// Sixteen outputs are computed side by side, from weights repacked at load into tiles of 16 rows
// (kernels/packed.py), each int32 lane adding two s16 x s16 products per instruction. The instruction
// set is chosen when the library is compiled for the CPU (-march, kernels/native.py), by the
// compiler's macros: AVX-512 VNNI vpdpwssd, AVX-512BW vpmaddwd + vpaddd, AVX-VNNI (256-bit vpdpwssd),
// AVX2 vpmaddwd + vpaddd (two passes of 8 lanes per tile; at 4+ rows from the tile's weights widened to
// int16 once, see wide_dot), NEON smull + addp (four passes of 4), or
// plain C++. Integer sums are exact and every path scales and accumulates a lane's blocks by the same
// fused multiply-adds in the same order, so every path gives the same bits (tests/test_simd_paths.py).
//
// The K pool is laid out transposed per block, [block][KV head][head_dim][block_size], so a block's
// scores are 16 lanes of one vector (V stays [slot][KV head][head_dim]); a block still occupies the
// same bytes, so whole-block copies are layout-blind.
//
// Batch invariance: every output of every row is computed by the same sequence of operations
// whatever else is in the batch: the activation scales are per row, integer sums are exact, the
// fp32 accumulation runs over blocks in a fixed order per output lane, and attention walks each
// row's blocks in order with its own online softmax. A token therefore gets the same logits alone,
// in a batch of 64, or after a prefix-cache hit, and prefill writes the same KV a decode would.
//
// Floating point: this file is compiled without -ffast-math and with -ffp-contract=off (native.py),
// so the compiler never reorders a sum or fuses a multiply-add on its own: a reduction's order is
// the one written here (fixed lane partial sums; `omp simd` only where order cannot matter: a max,
// elementwise work), fused multiply-adds
// are written out (std::fma, the intrinsics), and exp is the polynomial below rather than a vector
// math library's, whose results differ by instruction set. What is vectorized is then vectorized per
// lane, and a row's result is the same whatever the batch, the threads or the SIMD width.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define STRATUM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATUM_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define STRATUM_NEON 1
#endif
#if STRATUM_AVX512 || STRATUM_AVX2
#include <immintrin.h>
#elif STRATUM_NEON
#include <arm_neon.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;   // QK4_0 == QK4_1 == QK8_0
constexpr int64_t kTile = 16;    // outputs computed side by side

// How a packed segment stores its weights (kernels/packed.py FORMATS; the GGUF types each one takes):
//   kQ4   4-bit q, fp16 d and m per block of 32: q d + m                      (Q4_0, Q4_1)
//   kQ8   int8 q, fp16 d per block of 32: q d                                  (Q8_0)
//   kQ5   5-bit q (the 4-bit plane, then a plane of fifth bits), fp16 d per block of 32: m = -16 d
//                                                                              (Q5_0)
//   kQ5M  5-bit q, fp16 d and m per block of 32                                (Q5_1)
//   kQ4K  4-bit q; 6-bit sc and min per block of 32; fp16 D, Dmin per super-block of 256:
//         d = D sc, m = -Dmin min                                              (Q4_K)
//   kQ5K  5-bit q (as kQ5), scales as kQ4K                                     (Q5_K)
//   kQ6K  6-bit q (the 4-bit plane, then a plane of the top two bits), centred (q - 32); int8 sc_lo
//         (inputs 0-15), sc_hi (16-31) per block of 32; fp16 D per 256: d_lo = D sc_lo, d_hi = D sc_hi
//                                                                              (Q6_K)
//   kF16, kBF16  the 16-bit floats themselves, no scales                       (F16, BF16)
// A K-quant sub-block's scale, an fp16 times a 6- or 8-bit integer, is exact in fp32 (not in fp16): kQ4K,
// kQ5K and kQ6K keep the integers and the fp16 and multiply them in fp32 here, which gives that value.
// (3, int8 q with fp32 scales, is retired: no GGUF type takes it since kQ5K.)
enum Format : int64_t { kQ4 = 0, kQ8 = 1, kQ4K = 2, kF16 = 4, kBF16 = 5, kQ5 = 6, kQ5M = 7, kQ6K = 8, kQ5K = 9 };
constexpr bool is_4bit(Format f) { return f == kQ4 || f == kQ4K || f == kQ5 || f == kQ5M || f == kQ6K || f == kQ5K; }  // a nibble plane
constexpr int high_bits(Format f) { return f == kQ5 || f == kQ5M || f == kQ5K ? 1 : f == kQ6K ? 2 : 0; }  // a plane of them after it
constexpr bool is_float(Format f) { return f == kF16 || f == kBF16; }
// kQ4K, kQ5K, kQ6K: per tile and super-block of 8 blocks, the blocks' integer scales (2 x 16 bytes each) and
// then the super-block's fp16 D [, Dmin] (16 each): 320 or 288 bytes
constexpr int64_t kSuper = 8;
constexpr bool super_scales(Format f) { return f == kQ4K || f == kQ5K || f == kQ6K; }
constexpr int64_t super_bytes(Format f) { return kSuper * 2 * kTile + (f == kQ6K ? 1 : 2) * kTile * 2; }
// bytes of one tile-block (16 rows x 32 inputs) and its scales (values, fp16 or fp32; for the
// super-block formats the bytes a block takes on average)
constexpr int64_t block_bytes(Format f) {
  return is_4bit(f) ? kTile * kBlock / 8 * (4 + high_bits(f)) : is_float(f) ? kTile * kBlock * 2 : kTile * kBlock;
}
constexpr int64_t block_scales(Format f) {
  return super_scales(f) ? super_bytes(f) / kSuper : f == kQ8 || f == kQ5 ? kTile : is_float(f) ? 0 : 2 * kTile;
}
constexpr int64_t scale_size(Format f) { return super_scales(f) ? 1 : 2; }
template <Format kF>
using ScaleType = std::conditional_t<super_scales(kF), uint8_t, uint16_t>;
constexpr float kNoScore = -1e30f;
// Weights stream through once per step: the next tiles are fetched this many bytes ahead, since
// one core's hardware prefetcher alone left the step at ~60% of the read bandwidth (measured).
constexpr int64_t kPrefetch = 2048;

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}
inline float wide_to_float(uint16_t h, bool bf16) { return bf16 ? bf16_to_float(h) : half_to_float(h); }
inline float scale_value(uint16_t h) { return half_to_float(h); }
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }  // the top half of an fp32
inline void store(float* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

// e^x in fp32 from plain operations, the same bits scalar or vectorized on any instruction set
// (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 polynomial, 2^n from the exponent
// bits); within 2 ulp of expf. Below -87.3 it is 0 (no subnormal), above 88.7 clamped (finite).
inline float exp_fp32(float x) {
  const bool under = x < -87.3f;
  x = std::min(std::max(x, -87.3f), 88.7f);  // keeps n within int32 and 2^n normal
  const float t = x * 1.44269504088896341f + 12582912.f;  // round(x / ln2) in the low mantissa bits
  const float n = t - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return under ? 0.f : y;
}

// The name of the instruction set the projections were compiled for (`stratum info`, kernel choices).
#if STRATUM_AVX512 && defined(__AVX512VNNI__)
constexpr const char* kSimdPath = "avx512-vnni";
#elif STRATUM_AVX512
constexpr const char* kSimdPath = "avx512bw";
#elif STRATUM_AVX2 && defined(__AVXVNNI__)
constexpr const char* kSimdPath = "avx-vnni";
#elif STRATUM_AVX2
constexpr const char* kSimdPath = "avx2";
#elif STRATUM_NEON
constexpr const char* kSimdPath = "neon";
#else
constexpr const char* kSimdPath = "portable";
#endif

// Activations quantized per row and block: xq = round(x / dx), dx = max|x| / 32767, sx = dx * sum(xq).
struct QuantRows {
  std::vector<int16_t> q;
  std::vector<float> d, s;
  const float* x = nullptr;  // the fp32 rows themselves (fp16 / bf16 weights take them unquantized)
  int64_t k = 0, blocks = 0;

  void quantize(const float* x_in, int64_t rows, int64_t k_dim) {
    x = x_in;
    k = k_dim;
    blocks = k_dim / kBlock;
    q.resize(rows * k_dim);
    d.resize(rows * blocks);
    s.resize(rows * blocks);
    at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* xb = x_in + i * kBlock;  // rows are contiguous, so block i of the flat array
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float dx = amax / 32767.f;
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
          q[i * kBlock + j] = static_cast<int16_t>(v);
          sum += v;
        }
        d[i] = dx;
        s[i] = dx * static_cast<float>(sum);
      }
    });
  }
};

// The instruction set's side of the projections: `kLanes` outputs per vector (a part of the tile).
//   dot(acc, w, x): acc[i] += w[2i] x[0] + w[2i+1] x[1], w int16 pairs, x one pair of int16 (as int32)
//   nibbles(p, out): a part's bytes of one 64-byte group of a 4-bit tile-block -> its four input pairs
//   widen8(p): a part's int8 pairs of one 32-byte pair row of an 8-bit tile-block -> int16 pairs
#if STRATUM_AVX512
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
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), m = _mm512_set1_epi8(0x10);
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
  static __m512 bytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static __m512 sbytes(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) { return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)) : fp16(p); }  // 16-bit floats of L rows
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
#elif STRATUM_AVX2
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
  // as the AVX-512 ones, for the part's two 128-bit lanes L = 2 part, 2 part + 1
  static void high1(const uint8_t* h, int part, I& lo, I& hi) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))), m = _mm256_set1_epi8(0x10);
    const int l = 2 * part;
    lo = _mm256_and_si256(_mm256_sllv_epi64(b, _mm256_set_epi64x(3 - l, 3 - l, 4 - l, 4 - l)), m);
    hi = _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(l + 1, l + 1, l, l)), m);
  }
  static void high2(const uint8_t* h, int part, I& lo, I& hi) {
    const int l = 2 * part;
    const __m256i count = _mm256_set_epi64x(4 - 2 * l, 4 - 2 * l, 6 - 2 * l, 6 - 2 * l), m = _mm256_set1_epi8(static_cast<char>(0xC0));
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
  static __m256 bytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static __m256 sbytes(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) { return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)) : fp16(p); }  // 16-bit floats of L rows
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
#elif STRATUM_NEON
struct Simd {
  static constexpr int kLanes = 4, kRegs = 32;
  using F = float32x4_t;
  using I = int32x4_t;
  static I zero() { return vdupq_n_s32(0); }
  static I dot(I acc, I w, int32_t x) {  // w: four rows' int16 pairs; products widened, then pairs added
    const int16x8_t wv = vreinterpretq_s16_s32(w), xv = vreinterpretq_s16_s32(vdupq_n_s32(x));
    const int32x4_t lo = vmull_s16(vget_low_s16(wv), vget_low_s16(xv)), hi = vmull_high_s16(wv, xv);
    return vaddq_s32(acc, vpaddq_s32(lo, hi));
  }
  static void nibbles(const uint8_t* p, I out[4]) {
    const uint8x16_t raw = vld1q_u8(p);
    const uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(raw, 4);
    out[0] = vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(lo))), out[1] = vreinterpretq_s32_u16(vmovl_high_u8(lo));
    out[2] = vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(hi))), out[3] = vreinterpretq_s32_u16(vmovl_high_u8(hi));
  }
  static I widen8(const uint8_t* p) { return vreinterpretq_s32_s16(vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p)))); }
  // as the AVX-512 ones, for the part's one 128-bit lane L = part (per-byte shifts: no lane counts)
  static void high1(const uint8_t* h, int part, I& lo, I& hi) {
    const uint8x16_t b = vld1q_u8(h), m = vdupq_n_u8(0x10);
    lo = vreinterpretq_s32_u8(vandq_u8(vshlq_u8(b, vdupq_n_s8(static_cast<int8_t>(4 - part))), m));
    hi = vreinterpretq_s32_u8(vandq_u8(vshlq_u8(b, vdupq_n_s8(static_cast<int8_t>(-part))), m));
  }
  static void high2(const uint8_t* h, int part, I& lo, I& hi) {
    const int8x16_t count = vdupq_n_s8(static_cast<int8_t>(4 - 2 * part));
    const uint8x16_t m = vdupq_n_u8(0x30);
    lo = vreinterpretq_s32_u8(vandq_u8(vshlq_u8(vld1q_u8(h), count), m));
    hi = vreinterpretq_s32_u8(vandq_u8(vshlq_u8(vld1q_u8(h + 16), count), m));
  }
  static void nibbles_with(const uint8_t* p, I hlo, I hhi, I out[4]) {
    const uint8x16_t raw = vld1q_u8(p);
    const uint8x16_t lo = vorrq_u8(vandq_u8(raw, vdupq_n_u8(0x0F)), vreinterpretq_u8_s32(hlo));
    const uint8x16_t hi = vorrq_u8(vshrq_n_u8(raw, 4), vreinterpretq_u8_s32(hhi));
    out[0] = vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(lo))), out[1] = vreinterpretq_s32_u16(vmovl_high_u8(lo));
    out[2] = vreinterpretq_s32_u16(vmovl_u8(vget_low_u8(hi))), out[3] = vreinterpretq_s32_u16(vmovl_high_u8(hi));
  }
  static I sub16(I a, int16_t v) { return vreinterpretq_s32_s16(vsubq_s16(vreinterpretq_s16_s32(a), vdupq_n_s16(v))); }
  static float32x4_t bytes(const uint8_t* p) { return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(p))))); }
  static float32x4_t sbytes(const uint8_t* p) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p))))));
  }
  static F zerof() { return vdupq_n_f32(0.f); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) { return bf16 ? vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)) : fp16(p); }  // 16-bit floats of L rows
  static F set1(float x) { return vdupq_n_f32(x); }
  static F fp16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static I iadd(I a, I b) { return vaddq_s32(a, b); }
  static F to_f(I a) { return vcvtq_f32_s32(a); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static void store(float* out, F v, int64_t valid) {
    if (valid >= 4) return vst1q_f32(out, v);
    float tmp[4];
    vst1q_f32(tmp, v);
    for (int64_t i = 0; i < valid; ++i) out[i] = tmp[i];
  }
};
#endif

// A block's two scale values of one output lane in fp32, read as the format stores them: d and m
// (kQ6K: d_lo and d_hi); the K-quant ones multiplied out here, exactly.
template <Format kF>
inline void lane_scales(const ScaleType<kF>* sc, int64_t b, int64_t lane, float& s0, float& s1) {
  if constexpr (super_scales(kF)) {
    const uint8_t* sup = sc + b / kSuper * super_bytes(kF);
    const uint8_t* ints = sup + b % kSuper * 2 * kTile;
    uint16_t d[2];
    std::memcpy(&d[0], sup + kSuper * 2 * kTile + lane * 2, 2);
    if constexpr (kF != kQ6K) {
      std::memcpy(&d[1], sup + kSuper * 2 * kTile + (kTile + lane) * 2, 2);
      s0 = half_to_float(d[0]) * static_cast<float>(ints[lane]);
      s1 = -half_to_float(d[1]) * static_cast<float>(ints[kTile + lane]);
    } else {
      s0 = half_to_float(d[0]) * static_cast<float>(static_cast<int8_t>(ints[lane]));
      s1 = half_to_float(d[0]) * static_cast<float>(static_cast<int8_t>(ints[kTile + lane]));
    }
  } else {
    const ScaleType<kF>* sb = sc + b * block_scales(kF);
    s0 = scale_value(sb[lane]);
    s1 = kF == kQ5 ? s0 * -16.f : scale_value(sb[kTile + lane]);
  }
}

#if STRATUM_AVX512 || STRATUM_AVX2 || STRATUM_NEON
// lane_scales for the lanes part*L .. part*L + L - 1, the same products
template <Format kF>
inline void part_scales(const ScaleType<kF>* sc, int64_t b, int part, Simd::F& s0, Simd::F& s1) {
  constexpr int L = Simd::kLanes;
  if constexpr (super_scales(kF)) {
    const uint8_t* sup = sc + b / kSuper * super_bytes(kF);
    const uint8_t* ints = sup + b % kSuper * 2 * kTile + part * L;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(sup + kSuper * 2 * kTile) + part * L;
    if constexpr (kF != kQ6K) {
      s0 = Simd::mul(Simd::fp16(d), Simd::bytes(ints));
      s1 = Simd::mul(Simd::mul(Simd::fp16(d + kTile), Simd::set1(-1.f)), Simd::bytes(ints + kTile));
    } else {
      s0 = Simd::mul(Simd::fp16(d), Simd::sbytes(ints));
      s1 = Simd::mul(Simd::fp16(d), Simd::sbytes(ints + kTile));
    }
  } else {
    const ScaleType<kF>* sb = sc + b * block_scales(kF) + part * L;
    s0 = Simd::scale(sb);
    s1 = kF == kQ5 ? Simd::mul(s0, Simd::set1(-16.f)) : Simd::scale(sb + kTile);
  }
}

// The values of a part's lanes of group g (inputs 8g .. 8g+7) of a nibble-plane tile-block as four
// int16 pair vectors: the nibbles, with the high plane's bits above them (kQ6K: centred, q - 32).
template <Format kF>
inline void group_values(const uint8_t* wb, int g, int part, Simd::I p[4]) {
  const uint8_t* nib = wb + g * 64 + part * Simd::kLanes * 4;
  if constexpr (high_bits(kF) == 0) {
    Simd::nibbles(nib, p);
  } else {
    constexpr int64_t kPlane = kTile * kBlock / 2;  // the high plane follows the 256 bytes of nibbles
    Simd::I lo, hi;
    if constexpr (high_bits(kF) == 1) {
      Simd::high1(wb + kPlane + g * 16, part, lo, hi);
    } else {
      Simd::high2(wb + kPlane + g * 32, part, lo, hi);
    }
    Simd::nibbles_with(nib, lo, hi, p);
    if constexpr (kF == kQ6K)
      for (int c = 0; c < 4; ++c) p[c] = Simd::sub16(p[c], 32);
  }
}
#endif

// One tile of 16 outputs for MR rows, in weight format kF. w: the tile's blocks; scales: its scales
// (block_scales(kF) per block: fp16 d [, m], or fp32 d_lo, d_hi, m; or per super-block, its integer
// scales and fp16 values: `Format`); xq, xd, xs: the first
// row's quantized inputs, scales and scaled sums, xf its fp32 inputs (rows `k` values and `nb` blocks
// apart). out: MR rows of `ld` floats, `valid` of 16 written.
//
// Per block of 32 inputs and output lane, every path computes, in this order:
//   4-, 5-bit (kQ4, kQ4K, kQ5, kQ5M, kQ5K):  f = fma(float(sum q x), d dx, f); f = fma(m, sx, f)
//   8-bit (kQ8):        f = fma(float(sum q x), d dx, f)
//   6-bit (kQ6K):       f = fma(float(sum_{j<16} q x), d_lo dx, f); f = fma(float(sum_{j>=16} q x), d_hi dx, f)
//                       (q centred, no m term)
//   16-bit float:       a0 = fma chain over even inputs, a1 over odd inputs (from 0); f = f + (a0 + a1)
// (d, m as lane_scales gives them; integer sums are exact in any order; the float operations are the
// same ones in the same order).
template <int MR, Format kF>
inline void tile_dot(const uint8_t* w, const void* scales, int64_t blocks, const int16_t* xq, const float* xd,
                     const float* xs, const float* xf, int64_t k, int64_t nb, float* out, int64_t ld, int64_t valid) {
  using S = ScaleType<kF>;
  const S* sc = static_cast<const S*>(scales);
  constexpr int64_t kScales = block_scales(kF), kBytes = block_bytes(kF);
#if STRATUM_AVX512 || STRATUM_AVX2 || STRATUM_NEON
  using F = Simd::F;
  using I = Simd::I;
  constexpr int L = Simd::kLanes;
  // two integer accumulators per row hide the latency of a dependent vpdpwssd, where registers allow
  constexpr bool kTwo = Simd::kRegs >= 32 || MR <= 2;
  constexpr int64_t kScaleAhead = kScales ? kPrefetch * kScales * static_cast<int64_t>(sizeof(S)) / kBytes : 0;
  for (int part = 0; part < kTile / L; ++part) {  // the tile's lanes part*L .. part*L + L - 1
    F f[MR];
    for (int r = 0; r < MR; ++r) f[r] = Simd::zerof();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * kBytes;
      const S* sb = sc + b * kScales + part * L;
      if constexpr (is_float(kF)) {
        const uint16_t* wh = reinterpret_cast<const uint16_t*>(wb) + part * L;  // [input j][row]
        F a0[MR], a1[MR];
        for (int r = 0; r < MR; ++r) a0[r] = a1[r] = Simd::zerof();
        for (int j = 0; j < kBlock; j += 2) {
          if (part == 0) __builtin_prefetch(reinterpret_cast<const char*>(wb + j * 2 * kTile) + kPrefetch);
          const F w0 = Simd::wide(wh + j * kTile, kF == kBF16), w1 = Simd::wide(wh + (j + 1) * kTile, kF == kBF16);
          for (int r = 0; r < MR; ++r) {
            const float* xr = xf + r * k + b * kBlock;
            a0[r] = Simd::fma(w0, Simd::set1(xr[j]), a0[r]);
            a1[r] = Simd::fma(w1, Simd::set1(xr[j + 1]), a1[r]);
          }
        }
        for (int r = 0; r < MR; ++r) f[r] = Simd::add(f[r], Simd::add(a0[r], a1[r]));
        continue;
      } else {
        if (part == 0) __builtin_prefetch(reinterpret_cast<const char*>(sc + b * kScales) + kScaleAhead);
        I a0[MR], a1[MR];
        for (int r = 0; r < MR; ++r) a0[r] = a1[r] = Simd::zero();
        const int16_t* xb = xq + b * kBlock;
        if constexpr (is_4bit(kF)) {
          for (int g = 0; g < 4; ++g) {  // inputs 8g .. 8g+7 as four pairs, one pair per int32 lane and output
            if (part == 0) __builtin_prefetch(reinterpret_cast<const char*>(wb + g * 64) + kPrefetch);
            if (part == 0 && g < high_bits(kF))  // the high plane's 64 or 128 bytes after the nibbles
              __builtin_prefetch(reinterpret_cast<const char*>(wb + kTile * kBlock / 2 + g * 64) + kPrefetch);
            I p[4];
            group_values<kF>(wb, g, part, p);
            for (int r = 0; r < MR; ++r) {
              const int32_t* xr = reinterpret_cast<const int32_t*>(xb + r * k + g * 8);  // pairs of int16
              if constexpr (kF == kQ6K) {  // a scale per 16 inputs: groups 0-1 and 2-3 summed apart
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
          F dw, mw;
          part_scales<kF>(sc, b, part, dw, mw);
          if constexpr (kF == kQ6K) {  // dw, mw: d_lo, d_hi
            for (int r = 0; r < MR; ++r) {
              const F dx = Simd::set1(xd[r * nb + b]);
              f[r] = Simd::fma(Simd::to_f(a0[r]), Simd::mul(dw, dx), f[r]);
              f[r] = Simd::fma(Simd::to_f(a1[r]), Simd::mul(mw, dx), f[r]);
            }
          } else {
            for (int r = 0; r < MR; ++r) {
              f[r] = Simd::fma(Simd::to_f(Simd::iadd(a0[r], a1[r])), Simd::mul(dw, Simd::set1(xd[r * nb + b])), f[r]);
              f[r] = Simd::fma(mw, Simd::set1(xs[r * nb + b]), f[r]);
            }
          }
        } else {
          for (int p = 0; p < 8; ++p) {  // pair p of inputs 0..15 and pair p + 8 of 16..31, int8 sign-extended
            if (part == 0) __builtin_prefetch(reinterpret_cast<const char*>(wb + p * 64) + kPrefetch);
            const I w0 = Simd::widen8(wb + p * 32 + part * L * 2), w1 = Simd::widen8(wb + (p + 8) * 32 + part * L * 2);
            for (int r = 0; r < MR; ++r) {
              const int32_t* xr = reinterpret_cast<const int32_t*>(xb + r * k);
              if constexpr (kTwo) {
                a0[r] = Simd::dot(a0[r], w0, xr[p]);
                a1[r] = Simd::dot(a1[r], w1, xr[p + 8]);
              } else {
                a0[r] = Simd::dot(Simd::dot(a0[r], w0, xr[p]), w1, xr[p + 8]);
              }
            }
          }
          const F dw = Simd::scale(sb);  // kQ8
          for (int r = 0; r < MR; ++r)
            f[r] = Simd::fma(Simd::to_f(Simd::iadd(a0[r], a1[r])), Simd::mul(dw, Simd::set1(xd[r * nb + b])), f[r]);
        }
      }
    }
    if (valid > part * L)
      for (int r = 0; r < MR; ++r) Simd::store(out + r * ld + part * L, f[r], valid - part * L);
  }
#else
  // Portable form of the same arithmetic, lane by lane (layouts in kernels/packed.py).
  for (int r = 0; r < MR; ++r) {
    float f[kTile] = {0.f};
    const int16_t* xrow = xq + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* wb = w + b * kBytes;
      const S* sb = sc + b * kScales;
      for (int64_t lane = 0; lane < kTile; ++lane) {
        if constexpr (is_float(kF)) {
          const uint16_t* wh = reinterpret_cast<const uint16_t*>(wb);
          const float* xr = xf + r * k + b * kBlock;
          float a0 = 0.f, a1 = 0.f;
          for (int j = 0; j < kBlock; j += 2) {
            a0 = std::fma(wide_to_float(wh[j * kTile + lane], kF == kBF16), xr[j], a0);
            a1 = std::fma(wide_to_float(wh[(j + 1) * kTile + lane], kF == kBF16), xr[j + 1], a1);
          }
          f[lane] = f[lane] + (a0 + a1);
          continue;
        } else {
          const float dx = xd[r * nb + b], sx = xs[r * nb + b];
          const int16_t* xb = xrow + b * kBlock;
          if constexpr (is_4bit(kF)) {
            int32_t sum[2] = {0, 0};  // inputs 0-15, 16-31
            const int64_t l = lane / 4, kk = lane % 4;
            constexpr int64_t kPlane = kTile * kBlock / 2;
            for (int g = 0; g < 4; ++g)
              for (int h = 0; h < 2; ++h)
                for (int e = 0; e < 2; ++e) {
                  const int64_t r = h * 8 + kk * 2 + e;  // the byte within its 16 (module docstring of packed.py)
                  const uint8_t byte = wb[g * 64 + l * 16 + r];
                  int32_t lo = byte & 0xF, hi = byte >> 4;
                  if constexpr (high_bits(kF) == 1) {
                    const uint8_t bits = wb[kPlane + g * 16 + r];
                    lo |= ((bits >> l) & 1) << 4, hi |= ((bits >> (4 + l)) & 1) << 4;
                  } else if constexpr (high_bits(kF) == 2) {
                    lo |= ((wb[kPlane + g * 32 + r] >> (2 * l)) & 3) << 4, hi |= ((wb[kPlane + g * 32 + 16 + r] >> (2 * l)) & 3) << 4;
                  }
                  if constexpr (kF == kQ6K) lo -= 32, hi -= 32;
                  sum[g / 2] += lo * xb[g * 8 + 2 * h + e] + hi * xb[g * 8 + 4 + 2 * h + e];
                }
            float s0, s1;
            lane_scales<kF>(sc, b, lane, s0, s1);
            if constexpr (kF == kQ6K) {
              f[lane] = std::fma(static_cast<float>(sum[0]), s0 * dx, f[lane]);
              f[lane] = std::fma(static_cast<float>(sum[1]), s1 * dx, f[lane]);
            } else {
              f[lane] = std::fma(static_cast<float>(sum[0] + sum[1]), s0 * dx, f[lane]);
              f[lane] = std::fma(s1, sx, f[lane]);
            }
          } else {
            const int8_t* w8 = reinterpret_cast<const int8_t*>(wb);
            int32_t lo = 0, hi = 0;
            for (int p = 0; p < 8; ++p)
              for (int e = 0; e < 2; ++e) {
                lo += w8[p * 32 + lane * 2 + e] * xb[2 * p + e];
                hi += w8[(p + 8) * 32 + lane * 2 + e] * xb[16 + 2 * p + e];
              }
            f[lane] = std::fma(static_cast<float>(lo + hi), scale_value(sb[lane]) * dx, f[lane]);  // kQ8
          }
        }
      }
    }
    for (int64_t lane = 0; lane < std::min<int64_t>(valid, kTile); ++lane) out[r * ld + lane] = f[lane];
  }
#endif
}

// One segment of a projection: `rows` outputs in one format. data [tiles, blocks, block_bytes] uint8,
// scales [tiles, blocks, block_scales] (fp32 for the K formats, else fp16; none for fp16/bf16 weights).
struct Packed {
  const uint8_t* data;
  const void* scales;
  int64_t tiles, blocks, rows;
  Format format;

  static Packed of(const at::Tensor& data, const at::Tensor& scales, int64_t format, int64_t rows) {
    TORCH_CHECK(format >= kQ4 && format <= kQ5K && format != 3, "packed weight: unknown format ", format);
    const auto f = static_cast<Format>(format);
    TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.is_contiguous(), "packed weight: uint8 [tiles, blocks, bytes]");
    TORCH_CHECK(data.size(2) == block_bytes(f), "packed weight: format ", format, " has ", block_bytes(f), "-byte tile-blocks, not ",
                data.size(2));
    const int64_t per = super_scales(f) ? kSuper : 1;  // blocks per row of scales
    TORCH_CHECK(data.size(1) % per == 0, "packed weight: format ", format, " takes whole super-blocks of ", per * kBlock, " inputs");
    TORCH_CHECK(scales.scalar_type() == (super_scales(f) ? at::kByte : at::kHalf) &&
                scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == data.size(0) &&
                scales.size(1) == data.size(1) / per && scales.size(2) == block_scales(f) * per,
                "packed scales do not match the weight's format ", format);
    TORCH_CHECK(rows > (data.size(0) - 1) * kTile && rows <= data.size(0) * kTile, "packed weight: ", rows, " rows in ",
                data.size(0), " tiles");
    return {data.data_ptr<uint8_t>(), scales.data_ptr(), data.size(0), data.size(1), rows, f};
  }
  int64_t in_features() const { return blocks * kBlock; }
  int64_t bytes_per_tile() const { return blocks * block_bytes(format); }
  int64_t scale_bytes_per_tile() const { return blocks * block_scales(format) * scale_size(format); }
};

// A projection: its segments' outputs side by side (a fused projection whose parts differ in format).
using Projection = std::vector<Packed>;

int64_t out_features(const Projection& w) {
  int64_t n = 0;
  for (const auto& s : w) n += s.rows;
  return n;
}

#if STRATUM_AVX2
// AVX2 at several rows. tile_dot unpacks each 4-bit group again for every pass of MR <= 4 rows, and
// 16 registers hold no more than that; here the tile's weights are widened to int16 pairs once, into
// a buffer that stays in L1/L2 ([block][pair j: inputs 2j, 2j+1][16 lanes], the layout `group_values` and
// `widen8` give), and every pass of kWideRows rows reads them from there: the passes are then madd
// and add alone. Per lane the integer block sums are the same exact sums and the float operations
// the same ones in the same order as tile_dot's, so the bits do not change.
constexpr bool widens(Format f) { return f == kQ8 || is_4bit(f); }  // every 8-bit or nibble-plane format in use
constexpr int64_t kWideMinRows = 4;  // below this, widening costs more than the unpacking it saves
constexpr int kWideRows = 4;         // rows per pass: 8 accumulators, 2 weights, a broadcast, 2 products

template <Format kF>
void widen_tile(const uint8_t* w, int64_t blocks, __m256i* buf) {
  constexpr int64_t kBytes = block_bytes(kF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBytes;
    __m256i* bb = buf + b * 32;
    for (int64_t line = 0; line < kBytes; line += 64) __builtin_prefetch(wb + line + kPrefetch);
    if constexpr (is_4bit(kF)) {
      for (int g = 0; g < 4; ++g)
        for (int part = 0; part < 2; ++part) {
          __m256i p[4];
          group_values<kF>(wb, g, part, p);
          for (int i = 0; i < 4; ++i) _mm256_storeu_si256(bb + (4 * g + i) * 2 + part, p[i]);
        }
    } else {
      for (int j = 0; j < 16; ++j)
        for (int part = 0; part < 2; ++part) _mm256_storeu_si256(bb + j * 2 + part, Simd::widen8(wb + j * 32 + part * 16));
    }
  }
}

// MR rows of one tile from its widened weights; as tile_dot, with both 8-lane parts in one pass.
template <int MR, Format kF>
void wide_dot(const __m256i* buf, const void* scales, int64_t blocks, const int16_t* xq, const float* xd, const float* xs,
              int64_t k, int64_t nb, float* out, int64_t ld, int64_t valid) {
  const ScaleType<kF>* sc = static_cast<const ScaleType<kF>*>(scales);
  alignas(32) float f[MR][kTile] = {};
  __m256i a[MR][2];
  // pairs j0 .. j1 - 1 of block b into a (zeroed first)
  auto sums = [&](int64_t b, int j0, int j1) {
    for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    const __m256i* bb = buf + b * 32;
    for (int j = j0; j < j1; ++j) {
      const __m256i w0 = _mm256_loadu_si256(bb + 2 * j), w1 = _mm256_loadu_si256(bb + 2 * j + 1);
      for (int r = 0; r < MR; ++r) {
        const int32_t xv = reinterpret_cast<const int32_t*>(xq + r * k + b * kBlock)[j];
        a[r][0] = Simd::dot(a[r][0], w0, xv);  // vpdpwssd on AVX-VNNI
        a[r][1] = Simd::dot(a[r][1], w1, xv);
      }
    }
  };
  // f += float(a) * (d dx) for every row, in the lanes of `part`
  auto scaled = [&](int64_t b, int part, __m256 d) {
    for (int r = 0; r < MR; ++r) {
      float* fr = f[r] + part * 8;
      const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
      _mm256_store_ps(fr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][part]), _mm256_mul_ps(d, dx), _mm256_load_ps(fr)));
    }
  };
  // f += m sx for every row, in the lanes of `part`
  auto offset = [&](int64_t b, int part, __m256 m) {
    for (int r = 0; r < MR; ++r) {
      float* fr = f[r] + part * 8;
      _mm256_store_ps(fr, _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), _mm256_load_ps(fr)));
    }
  };
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (kF == kQ8) {
      sums(b, 0, 16);
      for (int part = 0; part < 2; ++part) scaled(b, part, Simd::scale(sc + b * block_scales(kF) + part * 8));
    } else if constexpr (kF == kQ6K) {  // a scale per 16 inputs: d_lo, then d_hi
      __m256 lo[2], hi[2];
      for (int part = 0; part < 2; ++part) part_scales<kF>(sc, b, part, lo[part], hi[part]);
      sums(b, 0, 8);
      for (int part = 0; part < 2; ++part) scaled(b, part, lo[part]);
      sums(b, 8, 16);
      for (int part = 0; part < 2; ++part) scaled(b, part, hi[part]);
    } else {  // d and m
      sums(b, 0, 16);
      for (int part = 0; part < 2; ++part) {
        __m256 d, m;
        part_scales<kF>(sc, b, part, d, m);
        scaled(b, part, d);
        offset(b, part, m);
      }
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(out + r * ld, f[r], valid * sizeof(float));
}
#endif

template <Format kF>
void tile_rows(const Packed& w, int64_t t, const QuantRows& x, int64_t rows, float* out, int64_t ld) {
  const uint8_t* wt = w.data + t * w.bytes_per_tile();
  const void* st = static_cast<const char*>(w.scales) + t * w.scale_bytes_per_tile();
  const int64_t valid = std::min(kTile, w.rows - t * kTile);
  float* o = out + t * kTile;
  int64_t r = 0;
#if STRATUM_AVX2
  if constexpr (widens(kF)) {
    if (rows >= kWideMinRows) {
      thread_local std::vector<int16_t> widened;  // 512 int16 per block
      widened.resize(w.blocks * kTile * kBlock);
      __m256i* buf = reinterpret_cast<__m256i*>(widened.data());
      widen_tile<kF>(wt, w.blocks, buf);
#define STRATUM_WIDE(MR) \
  wide_dot<MR, kF>(buf, st, w.blocks, x.q.data() + r * x.k, x.d.data() + r * x.blocks, x.s.data() + r * x.blocks, \
                   x.k, x.blocks, o + r * ld, ld, valid)
      for (; r + kWideRows <= rows; r += kWideRows) STRATUM_WIDE(kWideRows);
      switch (rows - r) {
        case 3: STRATUM_WIDE(3); break;
        case 2: STRATUM_WIDE(2); break;
        case 1: STRATUM_WIDE(1); break;
        default: break;
      }
#undef STRATUM_WIDE
      return;
    }
  }
#endif
#define STRATUM_TILE(MR)                                                                                                 \
  tile_dot<MR, kF>(wt, st, w.blocks, x.q.data() + r * x.k, x.d.data() + r * x.blocks, x.s.data() + r * x.blocks, \
                   x.x + r * x.k, x.k, x.blocks, o + r * ld, ld, valid)
  for (; r + 4 <= rows; r += 4) STRATUM_TILE(4);
  switch (rows - r) {
    case 3: STRATUM_TILE(3); break;
    case 2: STRATUM_TILE(2); break;
    case 1: STRATUM_TILE(1); break;
    default: break;
  }
#undef STRATUM_TILE
}

// out [rows, out_features(w)] = x @ w^T (x quantized, or fp32 for fp16/bf16 weights); the segments'
// tiles are shared out among the threads together
void linear(const Projection& w, const QuantRows& x, int64_t rows, float* out) {
  const int64_t ld = out_features(w);
  std::vector<int64_t> first{0}, column{0};
  for (const auto& s : w) {
    TORCH_CHECK(x.k == s.in_features(), "packed linear: input has ", x.k, " features, the weight ", s.in_features());
    first.push_back(first.back() + s.tiles);
    column.push_back(column.back() + s.rows);
  }
  at::parallel_for(0, first.back(), 1, [&](int64_t begin, int64_t end) {
    size_t s = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first[s + 1]) ++s;
      const Packed& seg = w[s];
      float* o = out + column[s];
      switch (seg.format) {
        case kQ4: tile_rows<kQ4>(seg, t - first[s], x, rows, o, ld); break;
        case kQ8: tile_rows<kQ8>(seg, t - first[s], x, rows, o, ld); break;
        case kQ4K: tile_rows<kQ4K>(seg, t - first[s], x, rows, o, ld); break;
        case kF16: tile_rows<kF16>(seg, t - first[s], x, rows, o, ld); break;
        case kBF16: tile_rows<kBF16>(seg, t - first[s], x, rows, o, ld); break;
        case kQ5: tile_rows<kQ5>(seg, t - first[s], x, rows, o, ld); break;
        case kQ5M: tile_rows<kQ5M>(seg, t - first[s], x, rows, o, ld); break;
        case kQ6K: tile_rows<kQ6K>(seg, t - first[s], x, rows, o, ld); break;
        case kQ5K: tile_rows<kQ5K>(seg, t - first[s], x, rows, o, ld); break;
      }
    }
  });
}

// The residual add, in place: one rounding per element, so the same bits at any vector width (and a
// loop here rather than a PyTorch add_, whose dispatch cost more than the add at one row).
void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float part[16] = {0.f};  // sixteen lane sums, then a fixed tree: the same order at any vector width
    for (int64_t i = 0; i < dim; ++i) part[i % 16] += xr[i] * xr[i];
    for (int w = 8; w > 0; w /= 2)
      for (int j = 0; j < w; ++j) part[j] += part[j + w];
    const float inv = 1.f / std::sqrt(part[0] / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = weight[i] * (xr[i] * inv);
  }
}

struct Step {  // one call's geometry and buffers
  int64_t tokens, hidden, heads, kv_heads, head_dim, block_size, max_blocks;
  float eps, scale;
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* tables;
  const int64_t* row_seq;
  const float* cos;
  const float* sin;
};

template <typename T>
using ScoresFn = void (*)(const float*, int64_t, const T*, float, float*);
template <typename T>
using ValuesFn = void (*)(const float*, const T*, int64_t, int64_t, float*, int64_t);

#if STRATUM_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
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

// acc[g] += sum_t p[g][t] * v[t] for G heads sharing the KV head, the accumulators held in registers.
template <typename T, int C, int G>
inline void block_values(const float* p, const T* v, int64_t stride, int64_t n, float* acc, int64_t bs) {
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * C + c) * 16);
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) {
      const __m512 vv = load16(v + t * stride + 16 * c);
      for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * bs + t]), vv, a[g][c]);
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g * C + c) * 16, a[g][c]);
}

#elif STRATUM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// block_scores of the AVX-512 path in two 8-lane halves: each lane's fma chain over i, then the
// scale, as there and in the plain loops, so the same bits.
template <typename T, int G>
inline void block_scores(const float* q, int64_t d, const T* kt, float scale, float* sc) {
  __m256 a[G][2];
  for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m256 k0 = load8(kt + i * 16), k1 = load8(kt + i * 16 + 8);
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

// block_values of the AVX-512 path: C 16-lane columns per head, walked 32 lanes at a time so the
// G x 4 accumulators stay in the sixteen registers; each lane's fma chain over t is unchanged.
template <typename T, int C, int G>
inline void block_values(const float* p, const T* v, int64_t stride, int64_t n, float* acc, int64_t bs) {
  static_assert(C % 2 == 0, "columns are walked in pairs of 16 lanes");
  for (int c0 = 0; c0 < 2 * C; c0 += 4) {
    __m256 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) a[g][c] = _mm256_loadu_ps(acc + g * C * 16 + (c0 + c) * 8);
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < 4; ++c) {
        const __m256 vv = load8(v + t * stride + (c0 + c) * 8);
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * bs + t]), vv, a[g][c]);
      }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * C * 16 + (c0 + c) * 8, a[g][c]);
  }
}
#endif

#if STRATUM_AVX512 || STRATUM_AVX2
// The register-blocked forms for the shapes they cover (nullptr: the plain loops).
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
      default: break;
    }
  return nullptr;
}
#endif

// Attention of every row over its own context (positions 0..pos), read in place from the pool.
// Work is split by KV head and by chunks of rows; inside a chunk the blocks are walked in order,
// so rows that share blocks (a prefill chunk's rows, decodes under one system prompt) read each
// block while it is in cache. Each row's arithmetic does not depend on the other rows.
template <typename T>
void attend(const Step& s, const float* q, const T* k_pool, const T* v_pool, float* out) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t slot_stride = s.kv_heads * d;
  constexpr int64_t kRows = 16;
  const int64_t chunks = (s.tokens + kRows - 1) / kRows;
#if STRATUM_AVX512 || STRATUM_AVX2
  const ScoresFn<T> scores_fn = scores_kernel<T>(bs, group);
  const ValuesFn<T> values_fn = values_kernel<T>(d, group);
#else
  const ScoresFn<T> scores_fn = nullptr;
  const ValuesFn<T> values_fn = nullptr;
#endif
  at::parallel_for(0, s.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
#if defined(__SSE__)
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr(saved_csr | 0x8040);  // FTZ | DAZ: exp() of peaked scores underflows into subnormals
#endif
    std::vector<float> acc(kRows * group * d), m(kRows * group), l(kRows * group), sc(group * bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % s.kv_heads, r0 = (item / s.kv_heads) * kRows;
      const int64_t r1 = std::min(s.tokens, r0 + kRows);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      int64_t blocks = 0;
      for (int64_t r = r0; r < r1; ++r) blocks = std::max(blocks, (s.positions[r] + bs) / bs);
      for (int64_t j = 0; j < blocks; ++j) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t ctx = s.positions[r] + 1, start = j * bs;
          if (start >= ctx) continue;
          const int64_t n = std::min(bs, ctx - start);
          const int64_t block = s.tables[s.row_seq[r] * s.max_blocks + j], base = block * bs;
          const T* kt = k_pool + (block * s.kv_heads + h) * d * bs;  // this block's keys of head h, [d][bs]
          const float* qr = q + (r * s.heads + h * group) * d;
          if (scores_fn != nullptr) {
            scores_fn(qr, d, kt, s.scale, sc.data());
          } else {
            for (int64_t g = 0; g < group; ++g) {  // block_scores' arithmetic, lane by lane
              float* sg = &sc[g * bs];
              for (int64_t t = 0; t < n; ++t) sg[t] = 0.f;
              for (int64_t i = 0; i < d; ++i) {
                const float qi = qr[g * d + i];
                const T* kr = kt + i * bs;
                for (int64_t t = 0; t < n; ++t) sg[t] = std::fma(qi, to_float(kr[t]), sg[t]);
              }
              for (int64_t t = 0; t < n; ++t) sg[t] *= s.scale;
            }
          }
          const int64_t rr = r - r0;
          for (int64_t g = 0; g < group; ++g) {
            float* sg = &sc[g * bs];
            float& mg = m[rr * group + g];
            float new_m = mg;
#pragma omp simd reduction(max : new_m)
            for (int64_t t = 0; t < n; ++t) new_m = std::max(new_m, sg[t]);
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) sg[t] = exp_fp32(sg[t] - new_m);
            float sum = 0.f;
            for (int64_t t = 0; t < n; ++t) sum += sg[t];
            const float rescale = exp_fp32(mg - new_m);
            l[rr * group + g] = l[rr * group + g] * rescale + sum;
            mg = new_m;
            float* a = &acc[(rr * group + g) * d];
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
          }
          if (values_fn != nullptr) {
            values_fn(sc.data(), v_pool + base * slot_stride + h * d, slot_stride, n, &acc[rr * group * d], bs);
          } else {
            for (int64_t t = 0; t < n; ++t) {
              const T* vv = v_pool + (base + t) * slot_stride + h * d;
              for (int64_t g = 0; g < group; ++g) {
                const float p = sc[g * bs + t];
                float* a = &acc[(rr * group + g) * d];
#pragma omp simd
                for (int64_t i = 0; i < d; ++i) a[i] = std::fma(p, to_float(vv[i]), a[i]);  // as block_values
              }
            }
          }
        }
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t rr = r - r0;
          const float inv = l[rr * group + g] > 0.f ? 1.f / l[rr * group + g] : 0.f;
          float* o = out + (r * s.heads + h * group + g) * d;
          const float* a = &acc[(rr * group + g) * d];
          for (int64_t i = 0; i < d; ++i) o[i] = a[i] * inv;
        }
    }
#if defined(__SSE__)
    _mm_setcsr(saved_csr);
#endif
  });
}

// qkv [T, (H + 2 KVH) D] -> q rotated into `q` [T, H, D]; k rotated and v written at each row's slot.
template <typename T>
void rotate_and_store(const Step& s, float* qkv, const float* q_norm, const float* k_norm, float* q, T* k_pool, T* v_pool) {
  const int64_t d = s.head_dim, half = d / 2, heads = s.heads + s.kv_heads;
  const int64_t row = (s.heads + 2 * s.kv_heads) * d;
  for (int64_t t = 0; t < s.tokens; ++t) {
    float* x = qkv + t * row;
    const float* c = s.cos + s.positions[t] * half;
    const float* sn = s.sin + s.positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + h * d;
      const float* norm = h < s.heads ? q_norm : k_norm;
      if (norm != nullptr) rms_norm(xh, norm, 1, d, s.eps, xh);  // Qwen3: per-head norm before rotation
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = xh[i], x2 = xh[i + half];
        xh[i] = x1 * c[i] - x2 * sn[i];
        xh[i + half] = x2 * c[i] + x1 * sn[i];
      }
    }
    std::memcpy(q + t * s.heads * d, x, s.heads * d * sizeof(float));
    const int64_t slot = s.slots[t], bs = s.block_size;
    T* kd = k_pool + (slot / bs) * s.kv_heads * d * bs + slot % bs;  // keys transposed per block: [KVH][d][bs]
    T* vd = v_pool + slot * s.kv_heads * d;
    for (int64_t i = 0; i < s.kv_heads * d; ++i) {
      store(kd + i * bs, x[s.heads * d + i]);
      store(vd + i, x[heads * d + i]);
    }
  }
}

void check_pool_access(const Step& s, const at::Tensor& tables, int64_t num_slots) {
  const int64_t num_blocks = num_slots / s.block_size;
  for (int64_t t = 0; t < s.tokens; ++t) {
    TORCH_CHECK(s.positions[t] >= 0, "packed_forward: negative position");
    TORCH_CHECK(s.slots[t] >= 0 && s.slots[t] < num_slots, "packed_forward: slot ", s.slots[t], " outside the pool");
    TORCH_CHECK(s.row_seq[t] >= 0 && s.row_seq[t] < tables.size(0), "packed_forward: row names no block table");
    TORCH_CHECK(s.positions[t] / s.block_size < s.max_blocks, "packed_forward: a context is longer than its block table");
    for (int64_t j = 0; j <= s.positions[t] / s.block_size; ++j) {
      const int64_t block = s.tables[s.row_seq[t] * s.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "packed_forward: block ", block, " outside the pool");
    }
  }
}

// The step's weights by name, from the list PackedStack.weights passes in this order: the norms,
// biases and q/k norms, then every layer's projections (qkv, o, gate_up, down) as (data, scales)
// pairs of their segments; `layout` gives, per layer and projection, the number of segments and each
// one's (format, rows).
struct StepWeights {
  at::Tensor in_norm, post_norm, final_norm;  // [L, hidden], [L, hidden], [hidden] fp32
  at::Tensor bias, q_norm, k_norm;  // qkv bias [L, n], q/k norms [L, D] fp32, or empty
  std::vector<std::array<Projection, 4>> layers;  // qkv, o, gate_up, down

  static StepWeights of(at::TensorList w, at::IntArrayRef layout) {
    TORCH_CHECK(w.size() >= 6, "packed_forward: norms, bias and q/k norms expected first");
    StepWeights sw{w[0], w[1], w[2], w[3], w[4], w[5], {}};
    const int64_t num_layers = sw.in_norm.size(0);
    size_t t = 6, i = 0;
    auto next = [&]() {
      TORCH_CHECK(i < layout.size(), "packed_forward: the layout ends early");
      return layout[i++];
    };
    for (int64_t l = 0; l < num_layers; ++l) {
      sw.layers.emplace_back();
      for (auto& proj : sw.layers.back()) {
        const int64_t segments = next();
        TORCH_CHECK(segments >= 1, "packed_forward: a projection without segments");
        for (int64_t j = 0; j < segments; ++j) {
          const int64_t format = next(), rows = next();
          TORCH_CHECK(t + 2 <= w.size(), "packed_forward: fewer weight tensors than the layout names");
          proj.push_back(Packed::of(w[t], w[t + 1], format, rows));
          t += 2;
        }
      }
    }
    TORCH_CHECK(t == w.size() && i == layout.size(), "packed_forward: more weights than the layout names");
    return sw;
  }
};

// x [T, hidden] fp32 (the embedded tokens), returned as the final-normed hidden states.
// weights: StepWeights' fields in order. tables [S, max_blocks] int64, row_seq [T]: each row's sequence.
// probe_layers / probe_rows: the rotated queries of these rows at these layers are returned too
// ([len(layers), len(rows), H, D]), for the attention-coverage telemetry.
std::tuple<at::Tensor, at::Tensor> packed_forward(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
                                                  const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& tables,
                                                  const at::Tensor& row_seq, at::TensorList k_caches, at::TensorList v_caches,
                                                  at::TensorList weight_list, at::IntArrayRef layout, int64_t num_heads,
                                                  int64_t num_kv_heads, double eps,
                                                  int64_t block_size, at::IntArrayRef probe_layers, const at::Tensor& probe_rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "packed_forward: x must be [T, hidden] fp32");
  const StepWeights w = StepWeights::of(weight_list, layout);
  const int64_t layers = w.in_norm.size(0), tokens = x_in.size(0), hidden = x_in.size(1);
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "packed_forward: one K and one V pool per layer");
  const int64_t head_dim = k_caches[0].size(2);
  TORCH_CHECK(k_caches[0].size(1) == num_kv_heads && num_heads % num_kv_heads == 0, "packed_forward: head mismatch");
  for (const auto& t : {positions, slot_mapping, row_seq})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == tokens, "packed_forward: one int64 per row");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(), "packed_forward: tables [S, N] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
              cos.size(-1) == head_dim / 2, "packed_forward: cos/sin [positions, D/2] fp32");
  const auto pool_type = k_caches[0].scalar_type();
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() && k_caches[l].sizes() == k_caches[0].sizes() &&
                v_caches[l].sizes() == k_caches[0].sizes() && k_caches[l].scalar_type() == pool_type &&
                v_caches[l].scalar_type() == pool_type, "packed_forward: pools must be contiguous and alike");
  TORCH_CHECK(pool_type == at::kFloat || pool_type == at::kBFloat16, "packed_forward: the pool is fp32 or bf16");
  const float* cos_p = cos.data_ptr<float>();
  Step s{tokens, hidden, num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(eps),
         static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))), positions.data_ptr<int64_t>(),
         slot_mapping.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), cos_p,
         sin.data_ptr<float>()};
  check_pool_access(s, tables, k_caches[0].size(0));
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(s.positions[t] < cos.size(0), "packed_forward: position beyond the rotary table");

  const int64_t q_size = num_heads * head_dim, qkv_size = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t inter = w.layers[0][3][0].in_features();
  for (const auto& proj : w.layers) {
    TORCH_CHECK(out_features(proj[0]) == qkv_size && out_features(proj[1]) == hidden && out_features(proj[2]) == 2 * inter &&
                out_features(proj[3]) == hidden && proj[0][0].in_features() == hidden && proj[2][0].in_features() == hidden,
                "packed_forward: projection shapes do not match the model");
  }
  for (const auto& norm : {w.in_norm, w.post_norm})
    TORCH_CHECK(norm.is_contiguous() && norm.sizes() == at::IntArrayRef({layers, hidden}), "packed_forward: norms [L, hidden]");
  const float* in_norm = w.in_norm.data_ptr<float>();
  const float* post_norm = w.post_norm.data_ptr<float>();

  auto x = x_in.clone();
  auto opt = x_in.options();
  auto h = at::empty({tokens, hidden}, opt), qkv = at::empty({tokens, qkv_size}, opt), q = at::empty({tokens, q_size}, opt);
  auto attn = at::empty({tokens, q_size}, opt), proj = at::empty({tokens, hidden}, opt);
  auto gu = at::empty({tokens, 2 * inter}, opt), act = at::empty({tokens, inter}, opt);
  const int64_t probes = probe_rows.numel();
  auto probe_q = at::zeros({static_cast<int64_t>(probe_layers.size()), probes, num_heads, head_dim}, opt);
  QuantRows xq;
  float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < layers; ++l) {
    rms_norm(xp, in_norm + l * hidden, tokens, hidden, s.eps, h.data_ptr<float>());
    xq.quantize(h.data_ptr<float>(), tokens, hidden);
    linear(w.layers[l][0], xq, tokens, qkv.data_ptr<float>());
    if (w.bias.numel()) qkv.add_(w.bias[l]);
    const float* qn = w.q_norm.numel() ? w.q_norm[l].data_ptr<float>() : nullptr;
    const float* kn = w.k_norm.numel() ? w.k_norm[l].data_ptr<float>() : nullptr;
    if (pool_type == at::kFloat) {
      rotate_and_store<float>(s, qkv.data_ptr<float>(), qn, kn, q.data_ptr<float>(), k_caches[l].data_ptr<float>(),
                              v_caches[l].data_ptr<float>());
      attend<float>(s, q.data_ptr<float>(), k_caches[l].data_ptr<float>(), v_caches[l].data_ptr<float>(), attn.data_ptr<float>());
    } else {
      auto* kp = reinterpret_cast<c10::BFloat16*>(k_caches[l].data_ptr<at::BFloat16>());
      auto* vp = reinterpret_cast<c10::BFloat16*>(v_caches[l].data_ptr<at::BFloat16>());
      rotate_and_store<c10::BFloat16>(s, qkv.data_ptr<float>(), qn, kn, q.data_ptr<float>(), kp, vp);
      attend<c10::BFloat16>(s, q.data_ptr<float>(), kp, vp, attn.data_ptr<float>());
    }
    for (size_t p = 0; p < probe_layers.size(); ++p)
      if (probe_layers[p] == l)
        for (int64_t i = 0; i < probes; ++i) probe_q[p][i].view({-1}).copy_(q[probe_rows[i].item<int64_t>()]);
    xq.quantize(attn.data_ptr<float>(), tokens, q_size);
    linear(w.layers[l][1], xq, tokens, proj.data_ptr<float>());
    add_into(xp, proj.data_ptr<float>(), tokens * hidden);
    rms_norm(xp, post_norm + l * hidden, tokens, hidden, s.eps, h.data_ptr<float>());
    xq.quantize(h.data_ptr<float>(), tokens, hidden);
    linear(w.layers[l][2], xq, tokens, gu.data_ptr<float>());
    const float* g = gu.data_ptr<float>();
    float* a = act.data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t) {
      const float* gt = g + t * 2 * inter;
      float* at = a + t * inter;
#pragma omp simd  // a vector exp: a scalar one per value cost more than the projections at 32 rows
      for (int64_t i = 0; i < inter; ++i) at[i] = gt[i] / (1.f + exp_fp32(-gt[i])) * gt[inter + i];
    }
    xq.quantize(a, tokens, inter);
    linear(w.layers[l][3], xq, tokens, proj.data_ptr<float>());
    add_into(xp, proj.data_ptr<float>(), tokens * hidden);
  }
  rms_norm(xp, w.final_norm.data_ptr<float>(), tokens, hidden, s.eps, h.data_ptr<float>());
  return {h, probe_q};
}

// x [M, K] fp32 -> [M, rows] fp32 through one packed segment (the output projection, and tests).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales, int64_t format, int64_t rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "packed_linear: x must be [M, K] fp32");
  const Projection w{Packed::of(data, scales, format, rows)};
  TORCH_CHECK(x.size(1) == w[0].in_features(), "packed_linear: x has ", x.size(1), " features, the weight ", w[0].in_features());
  const auto xc = x.contiguous();
  QuantRows xq;
  xq.quantize(xc.data_ptr<float>(), x.size(0), x.size(1));
  auto out = at::empty({x.size(0), rows}, x.options());
  linear(w, xq, x.size(0), out.data_ptr<float>());
  return out;
}

std::string packed_simd() { return kSimdPath; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("packed_simd() -> str", &packed_simd);
  m.def("packed_linear(Tensor x, Tensor data, Tensor scales, int format, int rows) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
  m.def("packed_forward(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor tables, "
        "Tensor row_seq, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] weights, int[] layout, int num_heads, "
        "int num_kv_heads, float eps, int block_size, int[] probe_layers, Tensor probe_rows) -> (Tensor, Tensor)");
  m.impl("packed_forward", c10::DispatchKey::CPU, TORCH_FN(packed_forward));
}
