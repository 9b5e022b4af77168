// One core: linear() on 1B- and 3B-shaped segments at several row counts; GMAC/s and weight GB/s.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include "forward.h"
using namespace stratum_step;
struct Rng { uint64_t s; uint64_t next() { uint64_t z = (s += 0x9E3779B97F4A7C15ull); z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; return z ^ (z >> 31); } };
struct Segment {
  std::vector<uint8_t> data, scales; Packed packed;
  Segment(Rng& rng, Format f, int64_t rows, int64_t k) {
    const int64_t tiles = (rows + kTile - 1) / kTile, blocks = k / kBlock;
    data.resize(tiles * blocks * block_bytes(f)); for (auto& b : data) b = rng.next();
    scales.resize(tiles * blocks * block_scales(f) * scale_size(f));
    for (int64_t s = 0; s < tiles * blocks / kSuper; ++s) { uint8_t* sup = scales.data() + s * super_bytes(f);
      for (int64_t i = 0; i < kSuper * 2 * kTile; ++i) sup[i] = f == kQ6K ? rng.next() : rng.next() % 64;
      for (int64_t i = 0; i < (f == kQ6K ? 1 : 2) * kTile; ++i) { uint16_t d = 0x2000 | (rng.next() & 0x3ff); std::memcpy(sup + kSuper * 2 * kTile + 2 * i, &d, 2); } }
    packed = {data.data(), scales.data(), tiles, blocks, rows, f};
  }
  size_t bytes() const { return data.size() + scales.size(); }
};
int main(int argc, char** argv) {
  Rng rng{1};
  struct Case { const char* name; Format f; int64_t n, k; };
  Case cases[] = {{"3b qkv q4k", kQ4K, 5120, 3072}, {"3b gu q4k", kQ4K, 16384, 3072}, {"3b down q6k", kQ6K, 3072, 8192}, {"qkv q4k", kQ4K, 3072, 2048}, {"gate_up q4k", kQ4K, 16384, 2048}, {"down q4k", kQ4K, 2048, 8192},
                  {"down q6k", kQ6K, 2048, 8192}, {"down q5k", kQ5K, 2048, 8192}, {"o q4_0", kQ4, 2048, 2048}, {"o q5_1", kQ5M, 2048, 2048}, {"head q6k", kQ6K, 49152, 2048}};
  std::vector<int64_t> rowsv = {1, 2, 4, 8, 64};
  if (argc > 1) { rowsv.clear(); for (int i = 1; i < argc; ++i) rowsv.push_back(std::atoll(argv[i])); }
  std::printf("[\n");
  bool first = true;
  for (auto& c : cases) {
    Segment seg(rng, c.f, c.n, c.k);
    for (int64_t rows : rowsv) {
      std::vector<float> x(rows * c.k); for (auto& v : x) v = (rng.next() >> 40) * (1.f / 16777216.f) - 0.5f;
      std::vector<float> out(rows * c.n);
      QuantRows xq(std::getenv("BITS") ? std::atoi(std::getenv("BITS")) : 16); xq.quantize(x.data(), rows, c.k);
      linear(Projection{seg.packed}, xq, rows, out.data());
      if (xq.int8()) {  // the int16 kernels on the same int8 values: the same bits
        QuantRows wide = xq; wide.qmax = 32767; std::vector<float> ref(rows * c.n);
        linear(Projection{seg.packed}, wide, rows, ref.data());
        if (std::memcmp(ref.data(), out.data(), ref.size() * 4) != 0) { std::fprintf(stderr, "MISMATCH %s rows %lld\n", c.name, (long long)rows); return 1; }
      }
      double best = 1e9; int reps = std::max<int64_t>(3, 64 / rows);
      for (int r = 0; r < reps; ++r) { auto t = std::chrono::steady_clock::now(); linear(Projection{seg.packed}, xq, rows, out.data());
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count()); }
      double macs = double(rows) * c.n * c.k;
      std::printf("%s{\"case\": \"%s\", \"rows\": %lld, \"ms\": %.3f, \"gmac_s\": %.2f, \"weight_gb_s\": %.2f}\n", first ? "" : ",", c.name, (long long)rows, best * 1e3, macs / best / 1e9, seg.bytes() / best / 1e9);
      first = false;
    }
  }
  std::printf("]\n");
}
