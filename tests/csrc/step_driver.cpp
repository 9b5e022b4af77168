// The native step's kernels (stratum/kernels/csrc/step/) on fixed inputs, without torch: every tile format
// through the projection at 1 to 9 rows, attention over fp32 and bf16 pools in several head shapes, and a
// whole two-layer forward. Prints one line per case, "name hash", the hash being FNV-1a over the output's
// bytes; tests/test_step_driver.py builds it for each SIMD family this machine runs (and for aarch64, run
// under qemu) and asserts every build prints the same lines.
#include <cstdio>
#include <string>

#include "forward.h"

using namespace stratum_step;

#if defined(STRATUM_EXPECT_SIMD)  // a build this CPU cannot run is still checked to be the family asked for
constexpr bool same(const char* a, const char* b) { return *a == *b && (*a == 0 || same(a + 1, b + 1)); }
static_assert(same(kSimdPath, STRATUM_EXPECT_SIMD), "-march built another SIMD family");
#endif

namespace {

struct Rng {  // splitmix64: the same numbers on every machine
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) {  // exact arithmetic on a 24-bit integer: no libm
    return lo + (hi - lo) * (static_cast<float>(next() >> 40) * (1.f / 16777216.f));
  }
  uint16_t half(int min_exp, int max_exp) {  // a normal fp16 of either sign with exponent in [min_exp, max_exp]
    const uint64_t r = next();
    const int e = min_exp + static_cast<int>(r % (max_exp - min_exp + 1));
    return static_cast<uint16_t>(((r >> 8) & 1) << 15 | (e + 15) << 10 | ((r >> 16) & 0x3FF));
  }
};

void print(const std::string& name, const void* data, size_t bytes) {
  uint64_t h = 0xCBF29CE484222325ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(h));
}

// Float outputs are finite and not all zero, or the driver fails: a hash of garbage proves nothing.
void print(const std::string& name, const std::vector<float>& v) {
  bool nonzero = false;
  for (float x : v) {
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "%s: a value is not finite\n", name.c_str());
      std::exit(1);
    }
    nonzero = nonzero || x != 0.f;
  }
  if (!nonzero) {
    std::fprintf(stderr, "%s: every value is zero\n", name.c_str());
    std::exit(1);
  }
  print(name, v.data(), v.size() * sizeof(float));
}

std::vector<float> floats(Rng& rng, int64_t n, float lo, float hi) {
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

const char* name_of(Format f) {
  static const char* names[] = {"q4", "q8", "q4k", "q8k", "f16", "bf16", "q5", "q5m", "q6k", "q5k"};
  return names[f];
}

// A segment's bytes, random but valid: any weight bits; normal fp16 scales; 6-bit K-quant sub-scales.
struct Segment {
  std::vector<uint8_t> data, scales;
  Packed packed;

  Segment(Rng& rng, Format f, int64_t rows, int64_t k) {
    const int64_t tiles = (rows + kTile - 1) / kTile, blocks = k / kBlock;
    data.resize(tiles * blocks * block_bytes(f));
    for (auto& b : data) b = static_cast<uint8_t>(rng.next());
    if (is_float(f))  // finite weights: a 16-bit float with a small exponent (bf16: the top of an fp32)
      for (size_t i = 0; i < data.size(); i += 2) {
        const uint16_t w = f == kF16 ? rng.half(-6, 0) : static_cast<uint16_t>(((rng.next() & 1) << 15) | (121 + rng.next() % 6) << 7 | (rng.next() & 0x7F));
        std::memcpy(&data[i], &w, 2);
      }
    scales.resize(tiles * blocks * block_scales(f) * scale_size(f));
    if (super_scales(f)) {
      for (int64_t s = 0; s < tiles * blocks / kSuper; ++s) {
        uint8_t* sup = scales.data() + s * super_bytes(f);
        for (int64_t i = 0; i < kSuper * 2 * kTile; ++i) sup[i] = static_cast<uint8_t>(f == kQ6K ? rng.next() : rng.next() % 64);
        for (int64_t i = 0; i < (f == kQ6K ? 1 : 2) * kTile; ++i) {
          const uint16_t d = rng.half(-14, -6);
          std::memcpy(sup + kSuper * 2 * kTile + 2 * i, &d, 2);
        }
      }
    } else {
      for (size_t i = 0; i < scales.size(); i += 2) {
        const uint16_t d = rng.half(-10, -4);
        std::memcpy(&scales[i], &d, 2);
      }
    }
    packed = {data.data(), scales.data(), tiles, blocks, rows, f};
  }
};

void projections(Rng& rng) {
  const Format formats[] = {kQ4, kQ8, kQ4K, kF16, kBF16, kQ5, kQ5M, kQ6K, kQ5K};
  const int64_t n = 50, k = 768;  // the last tile padded; three super-blocks; AVX2 int8 chunks of 16 + 8 blocks
  for (Format f : formats) {
    const Segment seg(rng, f, n, k);
    for (int bits : {16, 8})  // int8: the families with an int8 kernel (kDot8) and those without agree
      for (int64_t rows : {1, 2, 3, 4, 5, 7, 9}) {
        std::vector<float> x = floats(rng, rows * k, -2.f, 2.f);
        std::fill(x.begin(), x.begin() + std::min<int64_t>(k, 40), 0.f);  // a zero block: zero activation scale
        QuantRows xq(bits);
        xq.quantize(x.data(), rows, k);
        std::vector<float> out(rows * n);
        linear(Projection{seg.packed}, xq, rows, out.data());
        print(std::string("linear ") + name_of(f) + " int" + std::to_string(bits) + " rows=" + std::to_string(rows), out);
      }
  }
  const Segment a(rng, kQ4K, 40, k), b(rng, kQ6K, 24, k);  // a fused projection of two formats, side by side
  for (int64_t rows : {1, 6}) {
    std::vector<float> x = floats(rng, rows * k, -1.f, 1.f), out(rows * 64);
    QuantRows xq;
    xq.quantize(x.data(), rows, k);
    linear(Projection{a.packed, b.packed}, xq, rows, out.data());
    print("linear q4k+q6k rows=" + std::to_string(rows), out);
  }
}

// A step's rows: three sequences, one a 21-token prefill, two decoding at 40 and 6 (the last row of each).
struct Rows {
  std::vector<int64_t> positions, slots, tables, row_seq;
  int64_t max_blocks = 0;

  explicit Rows(int64_t bs) : max_blocks(64 / bs + 1) {
    const int64_t lengths[] = {21, 41, 7};
    for (int64_t s = 0; s < 3; ++s)
      for (int64_t j = 0; j < max_blocks; ++j) tables.push_back((s * max_blocks + j) * 7 % (3 * max_blocks));  // scattered
    for (int64_t s = 0; s < 3; ++s)
      for (int64_t p = s == 0 ? 0 : lengths[s] - 1; p < lengths[s]; ++p) {
        positions.push_back(p);
        row_seq.push_back(s);
        slots.push_back(tables[s * max_blocks + p / bs] * bs + p % bs);
      }
  }
  Step step(int64_t heads, int64_t kv_heads, int64_t d, int64_t bs, const float* cos, const float* sin) const {
    return {static_cast<int64_t>(positions.size()), heads * d, heads, kv_heads, d, bs, max_blocks, 1e-5f,
            1.f / std::sqrt(static_cast<float>(d)), positions.data(), slots.data(), tables.data(), row_seq.data(), cos, sin};
  }
};

template <typename T>
std::vector<T> pool(Rng& rng, int64_t n) {
  std::vector<T> p(n);
  for (auto& v : p) store(&v, rng.uniform(-1.f, 1.f));
  return p;
}

template <typename T>
void attention_case(Rng& rng, int64_t heads, int64_t kv_heads, int64_t d, int64_t bs, const char* type) {
  const Rows rows(bs);
  const std::vector<float> cos = floats(rng, 64 * d / 2, -1.f, 1.f), sin = floats(rng, 64 * d / 2, -1.f, 1.f);
  const Step s = rows.step(heads, kv_heads, d, bs, cos.data(), sin.data());
  const int64_t slots = 3 * rows.max_blocks * bs;
  std::vector<T> k = pool<T>(rng, slots * kv_heads * d), v = pool<T>(rng, slots * kv_heads * d);
  std::vector<float> qkv = floats(rng, s.tokens * (heads + 2 * kv_heads) * d, -2.f, 2.f);
  std::vector<float> norm = floats(rng, d, 0.5f, 1.5f), q(s.tokens * heads * d), out(s.tokens * heads * d);
  rotate_and_store(s, qkv.data(), kv_heads == 1 ? norm.data() : nullptr, kv_heads == 1 ? norm.data() : nullptr, q.data(),
                   k.data(), v.data());
  attend(s, q.data(), k.data(), v.data(), out.data());
  const std::string name = "attention " + std::string(type) + " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                           " d=" + std::to_string(d) + " bs=" + std::to_string(bs);
  print(name + " pool", k.data(), k.size() * sizeof(T));
  print(name, out);
}

void attention(Rng& rng) {
  const int64_t shapes[][3] = {{4, 4, 64}, {4, 2, 64}, {6, 2, 64}, {8, 2, 64}, {4, 2, 128}, {2, 1, 128}, {6, 3, 32}, {3, 1, 64},
                               {6, 2, 128}, {8, 2, 128}, {14, 2, 64}, {10, 1, 128}};  // and passes of four heads: 4 + 3, 4 + 4 + 2
  for (const auto& h : shapes)
    for (int64_t bs : {16, 4}) {
      attention_case<float>(rng, h[0], h[1], h[2], bs, "fp32");
      attention_case<BF16>(rng, h[0], h[1], h[2], bs, "bf16");
    }
}

// A two-layer model whose projections take every format, some as fused segments of two.
template <typename T>
void forward_case(Rng& rng, bool qwen, const char* type, int bits) {
  const int64_t hidden = 256, heads = 4, kv_heads = 2, d = 64, inter = 512, bs = 16, qkv = (heads + 2 * kv_heads) * d;
  const Format layout[2][4][2] = {{{kQ4, kQ4}, {kQ8, kQ8}, {kQ4K, kQ5K}, {kQ6K, kQ6K}},
                                  {{kQ5K, kQ6K}, {qwen ? kBF16 : kQ5, kQ5}, {kQ5M, kQ5M}, {qwen ? kF16 : kBF16, kBF16}}};
  const int64_t outs[4] = {qkv, hidden, 2 * inter, hidden}, ins[4] = {hidden, heads * d, hidden, inter};
  std::vector<std::unique_ptr<Segment>> segments;
  const std::vector<float> norms = floats(rng, 5 * hidden, 0.5f, 1.5f), bias = floats(rng, qkv, -0.5f, 0.5f);
  std::vector<LayerWeights> layers;
  for (int l = 0; l < 2; ++l) {
    layers.push_back({norms.data() + l * hidden, norms.data() + (2 + l) * hidden, qwen ? bias.data() : nullptr,
                      qwen ? norms.data() + 4 * hidden : nullptr, qwen ? norms.data() + 4 * hidden + d : nullptr, {}});
    for (int p = 0; p < 4; ++p) {
      const bool fused = layout[l][p][0] != layout[l][p][1];  // then the first segment takes 3/4 of the rows
      const int64_t first = fused ? outs[p] * 3 / 4 : outs[p];
      segments.push_back(std::make_unique<Segment>(rng, layout[l][p][0], first, ins[p]));
      layers.back().proj[p].push_back(segments.back()->packed);
      if (fused) {
        segments.push_back(std::make_unique<Segment>(rng, layout[l][p][1], outs[p] - first, ins[p]));
        layers.back().proj[p].push_back(segments.back()->packed);
      }
    }
  }
  const Rows rows(bs);
  const std::vector<float> cos = floats(rng, 64 * d / 2, -1.f, 1.f), sin = floats(rng, 64 * d / 2, -1.f, 1.f);
  const Step s = rows.step(heads, kv_heads, d, bs, cos.data(), sin.data());
  const int64_t slots = 3 * rows.max_blocks * bs * kv_heads * d;
  std::vector<T> k0(slots), v0(slots), k1(slots), v1(slots);
  T* k[2] = {k0.data(), k1.data()};
  T* v[2] = {v0.data(), v1.data()};
  std::vector<float> x = floats(rng, s.tokens * hidden, -1.f, 1.f), out(s.tokens * hidden), probe(2);
  const int64_t probe_layers[] = {1}, probe_rows[] = {0, s.tokens - 1};
  forward<T>(s, layers, norms.data() + 4 * hidden, k, v, Probes{probe_layers, 1, probe_rows, 2, 0.9, probe.data()}, bits, x.data(),
             out.data());
  const std::string name = std::string("forward ") + type + " int" + std::to_string(bits) + (qwen ? " bias, q/k norms" : "");
  print(name, out);
  print(name + " probes", probe);
  print(name + " pool", v1.data(), v1.size() * sizeof(T));
}

void exp_sweep() {
  std::vector<float> y;
  for (float x = -100.f; x < 100.f; x += 0.0137f) y.push_back(exp_fp32(x));
  print("exp_fp32", y);
}

}  // namespace

int main() {
  std::printf("simd %s\n", kSimdPath);
  Rng rng{42};
  exp_sweep();
  projections(rng);
  attention(rng);
  for (int bits : {16, 8}) {
    forward_case<float>(rng, false, "fp32", bits);
    forward_case<BF16>(rng, true, "bf16", bits);
  }
  return 0;
}
