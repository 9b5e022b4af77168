// One core: attend() for rows P0 .. P0 + R - 1 of one sequence (a prefill chunk, or R = 1 a decode row)
// over a random fp32 pool; ms a call, ns per row, block and KV head, and a hash of the output (the same
// bits before and after a kernel change). Default shape the 1 B's: 32 heads, 8 KV heads, head size 64.
//   c++ -std=c++17 -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off -fopenmp -march=native \
//       -Istratum/kernels/csrc/step scripts/perf/attention_bench.cpp -o /tmp/attention_bench
//   /tmp/attention_bench P0 R iterations [heads kv_heads head_dim]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include "forward.h"
using namespace stratum_step;
struct Rng { uint64_t state; uint64_t next() { uint64_t z = (state += 0x9E3779B97F4A7C15ull); z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; return z ^ (z >> 31);} float u(float lo, float hi) { return lo + (hi - lo) * (static_cast<float>(next() >> 40) * (1.f / 16777216.f)); } };
int main(int argc, char** argv) {
  const int64_t P0 = atoi(argv[1]), R = atoi(argv[2]), iters = atoi(argv[3]);
  const int64_t heads = argc > 4 ? atoi(argv[4]) : 32, kvh = argc > 5 ? atoi(argv[5]) : 8, d = argc > 6 ? atoi(argv[6]) : 64, bs = 16;
  const int64_t ctx = P0 + R, max_blocks = (ctx + bs - 1) / bs;
  std::vector<int64_t> positions, slots, tables, row_seq;
  for (int64_t j = 0; j < max_blocks; ++j) tables.push_back(j);
  for (int64_t p = P0; p < ctx; ++p) { positions.push_back(p); row_seq.push_back(0); slots.push_back(p); }
  Rng rng{1};
  std::vector<float> k(max_blocks * bs * kvh * d), v(k.size()), q(R * heads * d), out(R * heads * d);
  for (auto& x : k) x = rng.u(-1.f, 1.f);
  for (auto& x : v) x = rng.u(-1.f, 1.f);
  for (auto& x : q) x = rng.u(-3.f, 3.f);
  Step s{R, heads * d, heads, kvh, d, bs, max_blocks, 1e-5f, 1.f / std::sqrt((float)d), positions.data(), slots.data(), tables.data(), row_seq.data(), nullptr, nullptr};
  attend(s, q.data(), k.data(), v.data(), out.data());
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) attend(s, q.data(), k.data(), v.data(), out.data());
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
  uint64_t h = 0xCBF29CE484222325ull; auto* p = reinterpret_cast<const uint8_t*>(out.data());
  for (size_t i = 0; i < out.size() * 4; ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  double rb = 0; for (int64_t r = 0; r < R; ++r) rb += (positions[r] + bs) / bs;
  std::printf("P0=%ld R=%ld %.3f ms  %.1f ns/row-block/kvhead  hash %016llx\n", P0, R, ms, ms * 1e6 / (rb * kvh), (unsigned long long)h);
}
