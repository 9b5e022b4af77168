// Peak throughput of the int16/int8 dot instructions and fp32 FMA on one core (independent chains).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <class F> double bench(F f, long iters) {
  auto t = std::chrono::steady_clock::now(); f(iters);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
int main() {
  const long N = 200000000;
  volatile int sink = 0;
  // 12 independent vpmaddwd+vpaddd chains
  double t1 = bench([&](long n) {
    __m256i a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
    __m256i w = _mm256_set1_epi16(3), x = _mm256_set1_epi32(0x00010002);
    for (long k = 0; k < n; ++k) {
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi32(x, _mm256_madd_epi16(w, a[i]));
      __asm__ volatile("" : "+x"(w), "+x"(x));
    }
    __m256i s = a[0]; for (int i = 1; i < 12; ++i) s = _mm256_add_epi32(s, a[i]); sink = _mm256_extract_epi32(s, 0);
  }, N / 12);
  double t2 = bench([&](long n) {
    __m256i a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(2);
    for (long k = 0; k < n; ++k) {
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi16(x, _mm256_maddubs_epi16(w, a[i]));
      __asm__ volatile("" : "+x"(w), "+x"(x));
    }
    __m256i s = a[0]; for (int i = 1; i < 12; ++i) s = _mm256_add_epi32(s, a[i]); sink = _mm256_extract_epi32(s, 0);
  }, N / 12);
  double t3 = bench([&](long n) {
    __m256 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(i);
    __m256 w = _mm256_set1_ps(1.0001f), x = _mm256_set1_ps(0.9999f);
    for (long k = 0; k < n; ++k) {
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(w, a[i], x);
      __asm__ volatile("" : "+x"(w), "+x"(x));
    }
    __m256 s = a[0]; for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]); sink = (int)_mm256_cvtss_f32(s);
  }, N / 12);
  // madd with broadcast-from-memory x (as the kernel does)
  alignas(32) static int32_t xs[1024]; for (int i = 0; i < 1024; ++i) xs[i] = i;
  double t4 = bench([&](long n) {
    __m256i a[8]; for (int i = 0; i < 8; ++i) a[i] = _mm256_set1_epi32(i);
    __m256i w0 = _mm256_set1_epi16(3), w1 = _mm256_set1_epi16(5);
    for (long k = 0; k < n; ++k) {
      const int32_t* xp = xs + (k & 255) * 4;
      _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r) { __m256i x = _mm256_set1_epi32(xp[r]);
        a[2*r] = _mm256_add_epi32(a[2*r], _mm256_madd_epi16(w0, x)); a[2*r+1] = _mm256_add_epi32(a[2*r+1], _mm256_madd_epi16(w1, x)); }
      __asm__ volatile("" : "+x"(w0), "+x"(w1));
    }
    __m256i s = a[0]; for (int i = 1; i < 8; ++i) s = _mm256_add_epi32(s, a[i]); sink = _mm256_extract_epi32(s, 0);
  }, N / 8);
  std::printf("{\"vpmaddwd_per_s\": %.3g, \"int16_mac_per_s\": %.3g, \"vpmaddubsw_per_s\": %.3g, \"int8_mac_per_s\": %.3g, "
              "\"fma_per_s\": %.3g, \"fp32_mac_per_s\": %.3g, \"madd_bcast_4x2_per_s\": %.3g, \"madd_bcast_mac_per_s\": %.3g}\n",
              N / t1, N / t1 * 16, N / t2, N / t2 * 32, N / t3, N / t3 * 8, N / t4, N / t4 * 16);
}
