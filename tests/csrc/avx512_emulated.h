// AVX-512 on a CPU without it, for tests/test_step_driver.py: SIMDe (Debian's libsimde-dev) implements
// the intrinsics in portable code under their own names, and the macros the step's family choice reads
// are defined after every system header SIMDe took in, so simd.h builds the AVX-512 family (with VNNI
// where STRATUM_EMULATE_VNNI is defined) and it runs here. Integer instructions are emulated exactly;
// the float ones the step uses (fma, mul, add, conversions) round as the hardware does.
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// what SIMDe 0.7.4 lacks or misdeclares, element by element
static inline simde__m512 stratum_cvtepi32_ps(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = static_cast<float>(p.i32[i]);
  return simde__m512_from_private(r);
}
static inline simde__m512i stratum_cvtepu8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.u8[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i stratum_cvtepi8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.i8[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i stratum_cvtepu16_epi32(simde__m256i a) {
  simde__m256i_private p = simde__m256i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.u16[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512 stratum_cvtph_ps(simde__m256i a) {  // F16C's exact conversion, one value at a time
  simde__m256i_private p = simde__m256i_to_private(a);
  simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = _cvtsh_ss(p.u16[i]);
  return simde__m512_from_private(r);
}
static inline void stratum_mask_storeu_ps(void* out, simde__mmask16 m, simde__m512 v) {
  simde__m512_private p = simde__m512_to_private(v);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) static_cast<float*>(out)[i] = p.f32[i];
}
#define _mm512_cvtepi32_ps stratum_cvtepi32_ps
#define _mm512_cvtepu8_epi32 stratum_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 stratum_cvtepi8_epi32
#define _mm512_cvtepu16_epi32 stratum_cvtepu16_epi32
#define _mm512_cvtph_ps stratum_cvtph_ps
#define _mm512_mask_storeu_ps stratum_mask_storeu_ps
#undef _mm512_madd_epi16  // SIMDe 0.7.4's alias takes four arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

#define __AVX512F__ 1
#define __AVX512BW__ 1
#if defined(STRATUM_EMULATE_VNNI)
#define __AVX512VNNI__ 1
#endif
