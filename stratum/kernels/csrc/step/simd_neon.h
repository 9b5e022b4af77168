// NEON (AArch64): the 16-lane tile in four passes of 4 lanes, smull + addp per pair of inputs; attention
// takes the plain loops. Checked under qemu-aarch64 against the x86 paths (tests/test_step_driver.py).
#pragma once

#include <arm_neon.h>

namespace stratum_step {

constexpr const char* kSimdPath = "neon";
constexpr int64_t kWideMinRows = 0;  // no widened path: tile_dot's passes of 4 rows
constexpr bool kDot8 = false;  // no int8 kernel: int8 activations run the int16 one, which gives the same sums

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
  // as the AVX-512 ones (simd_avx512.h), for the part's one 128-bit lane L = part (per-byte shifts: no lane counts)
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
  static F bytes(const uint8_t* p) { return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(p))))); }
  static F sbytes(const uint8_t* p) {
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p))))));
  }
  static F zerof() { return vdupq_n_f32(0.f); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) { return bf16 ? vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)) : fp16(p); }
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

// No register-blocked attention on NEON yet: attention.h's plain loops, which compute the same bits.
template <typename T>
ScoresFn<T> scores_kernel(int64_t, int64_t) {
  return nullptr;
}
template <typename T>
ValuesFn<T> values_kernel(int64_t, int64_t) {
  return nullptr;
}

template <typename T>
RowsScoresFn<T> rows_scores_kernel(int64_t, int64_t) {
  return nullptr;
}
constexpr int64_t kScoreRows = 1;

}  // namespace stratum_step
