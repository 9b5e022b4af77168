// Plain C++, for a CPU without the families above (x86-64 before AVX2, other architectures): the NEON
// family's 4-lane operations written out lane by lane, so tile_dot is one code for every family and
// this path computes exactly what the vector ones do. Attention takes the plain loops.
#pragma once

namespace stratum_step {

constexpr const char* kSimdPath = "portable";
constexpr int64_t kWideMinRows = 0;  // no widened path: tile_dot's passes of 4 rows
constexpr bool kDot8 = false;  // no int8 kernel: int8 activations run the int16 one, which gives the same sums

struct Simd {
  static constexpr int kLanes = 4, kRegs = 32;  // kRegs: two accumulators per row (the sums are exact either way)
  struct F {
    float v[4];
  };
  struct I {  // one vector read three ways; each operation names the view it reads and writes
    int32_t s[4];   // int32 lanes: the accumulators
    int16_t h[8];   // int16 pairs: a lane's two inputs' q
    uint8_t b[16];  // bytes: a high plane's bits in place above the nibbles
  };
  static I zero() { return I{}; }
  static I dot(I acc, const I& w, int32_t x) {
    int16_t xv[2];
    std::memcpy(xv, &x, sizeof xv);  // the pair as it lies in memory: input 2j, then 2j + 1
    for (int i = 0; i < 4; ++i) acc.s[i] += int32_t{w.h[2 * i]} * xv[0] + int32_t{w.h[2 * i + 1]} * xv[1];
    return acc;
  }
  static void nibbles(const uint8_t* p, I out[4]) { nibbles_with(p, I{}, I{}, out); }
  static I widen8(const uint8_t* p) {
    I v{};
    for (int j = 0; j < 8; ++j) v.h[j] = static_cast<int8_t>(p[j]);
    return v;
  }
  // the part's row quad L = part: bit L (low nibbles) and bit 4 + L (high nibbles) of each byte, as 0x10
  static void high1(const uint8_t* h, int part, I& lo, I& hi) {
    lo = hi = I{};
    for (int j = 0; j < 16; ++j) {
      lo.b[j] = static_cast<uint8_t>(((h[j] >> part) & 1) << 4);
      hi.b[j] = static_cast<uint8_t>(((h[j] >> (4 + part)) & 1) << 4);
    }
  }
  // bits 2L, 2L + 1 of the low nibbles' 16 bytes and of the high nibbles' 16, as 0x00..0x30
  static void high2(const uint8_t* h, int part, I& lo, I& hi) {
    lo = hi = I{};
    for (int j = 0; j < 16; ++j) {
      lo.b[j] = static_cast<uint8_t>(((h[j] >> (2 * part)) & 3) << 4);
      hi.b[j] = static_cast<uint8_t>(((h[16 + j] >> (2 * part)) & 3) << 4);
    }
  }
  static void nibbles_with(const uint8_t* p, const I& hlo, const I& hhi, I out[4]) {
    for (int c = 0; c < 4; ++c) out[c] = I{};
    for (int j = 0; j < 16; ++j) {
      const int16_t lo = static_cast<int16_t>((p[j] & 0x0F) | hlo.b[j]), hi = static_cast<int16_t>((p[j] >> 4) | hhi.b[j]);
      out[j / 8].h[j % 8] = lo;  // bytes 0-7, then 8-15: the pairs (8g, 8g+1), then (8g+2, 8g+3)
      out[2 + j / 8].h[j % 8] = hi;
    }
  }
  static I sub16(I a, int16_t v) {
    for (int j = 0; j < 8; ++j) a.h[j] = static_cast<int16_t>(a.h[j] - v);
    return a;
  }
  static F bytes(const uint8_t* p) { return F{{float(p[0]), float(p[1]), float(p[2]), float(p[3])}}; }
  static F sbytes(const uint8_t* p) {
    const auto s = [&](int i) { return static_cast<float>(static_cast<int8_t>(p[i])); };
    return F{{s(0), s(1), s(2), s(3)}};
  }
  static F zerof() { return F{}; }
  static F add(F a, F b) { return lanes(a, b, [](float x, float y) { return x + y; }); }
  static F scale(const uint16_t* p) { return fp16(p); }
  static F wide(const uint16_t* p, bool bf16) { return bf16 ? load(p, bf16_to_float) : fp16(p); }
  static F set1(float x) { return F{{x, x, x, x}}; }
  static F fp16(const uint16_t* p) { return load(p, half_to_float); }
  static I iadd(I a, const I& b) {
    for (int i = 0; i < 4; ++i) a.s[i] += b.s[i];
    return a;
  }
  static F to_f(const I& a) { return F{{float(a.s[0]), float(a.s[1]), float(a.s[2]), float(a.s[3])}}; }
  static F fma(F a, F b, F c) {
    for (int i = 0; i < 4; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static F mul(F a, F b) { return lanes(a, b, [](float x, float y) { return x * y; }); }
  static void store(float* out, const F& v, int64_t valid) {
    for (int64_t i = 0; i < std::min<int64_t>(valid, 4); ++i) out[i] = v.v[i];
  }

 private:
  template <typename Op>
  static F lanes(F a, const F& b, Op op) {
    for (int i = 0; i < 4; ++i) a.v[i] = op(a.v[i], b.v[i]);
    return a;
  }
  template <typename Convert>
  static F load(const uint16_t* p, Convert convert) {
    return F{{convert(p[0]), convert(p[1]), convert(p[2]), convert(p[3])}};
  }
};

// No register-blocked attention here: attention.h's plain loops are this family's.
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
