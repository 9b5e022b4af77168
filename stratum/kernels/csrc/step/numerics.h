// The native step's arithmetic that every SIMD family shares: the constants of the tiles, the 16-bit
// float conversions, exp, the activations' int16 form, RMSNorm, and the threads.
//
// Why every family gives the same bits (tests/test_simd_paths.py, tests/test_step_driver.py): the step
// is compiled without -ffast-math and with -ffp-contract=off (kernels/native.py), so the compiler never
// reorders a sum or fuses a multiply-add on its own (-fno-trapping-math only lets it vectorize exp's
// clamps as selects). A reduction's order is the one written here (fixed
// lane partial sums; `omp simd` only where order cannot matter: a max, elementwise work); fused
// multiply-adds are written out (std::fma, the intrinsics); exp is the polynomial below, not a vector
// math library's, whose results differ by instruction set; integer sums are exact in any order. What
// is vectorized is then vectorized per lane, and a row's result is the same whatever the batch, the
// threads or the SIMD width. Nothing here may depend on torch: the test driver builds it for aarch64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(STRATUM_TORCH)
#include <ATen/Parallel.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#if defined(__GNUC__)
#define STRATUM_INLINE inline __attribute__((always_inline))
#else
#define STRATUM_INLINE inline
#endif

namespace stratum_step {

constexpr int64_t kBlock = 32;  // inputs per quantization block: QK4_0 == QK4_1 == QK8_0 == a K-quant sub-block
constexpr int64_t kTile = 16;   // outputs computed side by side
constexpr float kNoScore = -1e30f;
// Weights stream through once per step: the next tiles are fetched this many bytes ahead, since
// one core's hardware prefetcher alone left the step at ~60% of the read bandwidth (measured).
constexpr int64_t kPrefetch = 2048;

inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p);
#endif
}

// [begin, end) shared out among the threads: ATen's pool in the library (the engine sets its size), one
// pass in the test driver. Callers never let a result depend on how the range is cut.
template <typename Fn>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
#if defined(STRATUM_TORCH)
  at::parallel_for(begin, end, grain, fn);
#else
  (void)grain;
  if (begin < end) fn(begin, end);
#endif
}

// pass(std::integral_constant<int, R>{}, r) for rows r .. r + R - 1: passes of four rows, the last one to
// three in one pass (a kernel's row count is a template argument, its accumulators registers).
template <typename Pass>
inline void passes_of_four(int64_t rows, const Pass& pass) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pass(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: return pass(std::integral_constant<int, 3>{}, r);
    case 2: return pass(std::integral_constant<int, 2>{}, r);
    case 1: return pass(std::integral_constant<int, 1>{}, r);
    default: return;
  }
}

// A float buffer on a 64-byte boundary (as ATen allocates), for the step's intermediate rows.
struct Buffer {
  std::unique_ptr<float, decltype(&std::free)> p{nullptr, &std::free};
  explicit Buffer(int64_t n) : p(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64 * 64) + 64)), &std::free) {}
  float* get() const { return p.get(); }
};

inline float bits_to_float(uint32_t bits) {
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

// IEEE half to float, exactly (integer operations only, so the same on every machine and path).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000 | man << 13 | (man ? 0x400000 : 0));  // inf; NaN made quiet
  if (exp != 0) return bits_to_float(sign | (exp + 112) << 23 | man << 13);
  const float tiny = static_cast<float>(man) * bits_to_float(0x33800000);  // 2^-24: exact, and normal in fp32
  return sign ? -tiny : tiny;
}
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// A bf16 KV pool's element: the top half of an fp32, rounded to nearest even (as c10::BFloat16, whose
// tensors the library's pools are; same size and layout).
struct BF16 {
  uint16_t bits;
};
inline float to_float(float x) { return x; }
inline float to_float(BF16 x) { return bf16_to_float(x.bits); }
inline void store(float* p, float x) { *p = x; }
inline void store(BF16* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  p->bits = std::isnan(x) ? 0x7FC0 : static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFF) >> 16);
}

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

// Subnormals flushed to zero, inputs and results, for a scope (attention: exp() of peaked scores
// underflows into them, and they are slow). Both architectures flush, so they agree; elsewhere the
// portable build keeps IEEE subnormals.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#elif defined(__aarch64__)
  FlushDenormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_ | (uint64_t{1} << 24)));  // FZ
  }
  ~FlushDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

// Activations quantized per row and block: xq = round(x / dx), dx = max|x| / qmax, sx = dx * sum(xq), with
// qmax 32767 (int16, the default) or 127 (int8, as llama.cpp's q8 blocks; the user's choice: it cost 1.5
// points of top-1 agreement with the fp32 model, kernels/numerics.py). Either way each block's integer
// sums are exact, so a family that has an int8 kernel (kDot8) and one that reads the same values as int16
// give the same bits. For int8 the values are kept as bytes too (q8), and each half block's sum (h).
struct QuantRows {
  std::vector<int16_t> q;
  std::vector<int8_t> q8;
  std::vector<float> d, s;
  std::vector<int32_t> h;    // int8 only: sum(xq) of inputs 0-15 and 16-31 of each block
  const float* x = nullptr;  // the fp32 rows themselves (fp16 / bf16 weights take them unquantized)
  int64_t k = 0, blocks = 0;
  int32_t qmax = 32767;

  explicit QuantRows(int bits = 16) : qmax(bits == 8 ? 127 : 32767) {}
  bool int8() const { return qmax == 127; }

  void quantize(const float* x_in, int64_t rows, int64_t k_dim) {
    x = x_in;
    k = k_dim;
    blocks = k_dim / kBlock;
    q.resize(rows * k_dim);
    d.resize(rows * blocks);
    s.resize(rows * blocks);
    if (int8()) {
      q8.resize(rows * k_dim);
      h.resize(rows * blocks * 2);
    }
    parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantize_block(x_in + i * kBlock, i);  // rows are contiguous
    });
  }

 private:
  // Loops the compiler vectorizes (`omp simd`: a max and integer sums, exact in any order): a row of
  // one-row decode's ~230 thousand inputs a step took ~0.6 ms as one scalar loop (1 B shape, measured).
  void quantize_block(const float* xb, int64_t i) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float top = static_cast<float>(qmax);
    const float dx = amax / top;
    const float inv = amax > 0.f ? top / amax : 0.f;
    int32_t v[kBlock];
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) v[j] = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
    int32_t lo = 0, hi = 0;
#pragma omp simd reduction(+ : lo, hi)
    for (int64_t j = 0; j < kBlock / 2; ++j) lo += v[j], hi += v[j + kBlock / 2];
    int16_t* qb = q.data() + i * kBlock;
    for (int64_t j = 0; j < kBlock; ++j) qb[j] = static_cast<int16_t>(v[j]);
    if (int8()) {
      int8_t* q8b = q8.data() + i * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) q8b[j] = static_cast<int8_t>(v[j]);
      h[2 * i] = lo, h[2 * i + 1] = hi;
    }
    d[i] = dx;
    s[i] = dx * static_cast<float>(lo + hi);
  }
};

// Four int8 inputs (QuantRows::q8) as one int32, for the int8 kernels' broadcasts.
inline int32_t quad_of(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The residual add, in place: one rounding per element, so the same bits at any vector width (and a
// loop here rather than a PyTorch add_, whose dispatch cost more than the add at one row).
inline void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

inline void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps, float* out) {
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

}  // namespace stratum_step
