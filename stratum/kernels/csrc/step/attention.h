// Attention of every row over its own context, read in place from the paged KV pool, after rotary and
// the pool write of the step's new keys and values.
//
// The K pool is laid out transposed per block, [block][KV head][head_dim][block_size], so a block's
// scores are 16 lanes of one vector (V stays [slot][KV head][head_dim]); a block still occupies the
// same bytes, so whole-block copies are layout-blind. Each row walks its blocks in order with its own
// online softmax; the family's register-blocked kernels (simd.h) and the plain loops here compute each
// lane by the same fma chain, so the same bits.
#pragma once

#include "simd.h"

namespace stratum_step {

struct Step {  // one call's geometry and per-row tables
  int64_t tokens, hidden, heads, kv_heads, head_dim, block_size, max_blocks;
  float eps, scale;
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* tables;   // [sequences, max_blocks]: each sequence's blocks in order
  const int64_t* row_seq;  // each row's sequence
  const float* cos;        // [positions, head_dim / 2]
  const float* sin;
};

// The state of one chunk of rows of one KV head: per row and query head the running max m, the sum l
// and the unnormalized output acc; sc holds one block's scores of the rows of one run (attend_rows),
// top and sum that run's new maxima and block sums.
struct Softmax {
  std::vector<float> acc, m, l, sc, top, sum;
  Softmax(int64_t rows, int64_t run, int64_t group, int64_t d, int64_t bs)
      : acc(rows * group * d), m(rows * group), l(rows * group), sc(run * group * bs), top(run * group), sum(run * group) {}
  void reset() {
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(m.begin(), m.end(), kNoScore);
    std::fill(l.begin(), l.end(), 0.f);
  }
};

// block_scores' arithmetic (simd.h), lane by lane: the first n of the block's slots.
template <typename T>
inline void plain_scores(const float* qr, int64_t group, int64_t d, const T* kt, int64_t bs, int64_t n, float scale, float* sc) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = sc + g * bs;
    for (int64_t t = 0; t < n; ++t) sg[t] = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      const float qi = qr[g * d + i];
      const T* kr = kt + i * bs;
      for (int64_t t = 0; t < n; ++t) sg[t] = std::fma(qi, to_float(kr[t]), sg[t]);
    }
    for (int64_t t = 0; t < n; ++t) sg[t] *= scale;
  }
}

// block_values' arithmetic, lane by lane: acc[g] += sum_t p[g][t] v[t].
template <typename T>
inline void plain_values(const float* sc, const T* v, int64_t stride, int64_t n, int64_t group, int64_t d, int64_t bs, float* acc) {
  for (int64_t t = 0; t < n; ++t) {
    const T* vv = v + t * stride;
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc[g * bs + t];
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] = std::fma(p, to_float(vv[i]), a[i]);
    }
  }
}

// A KV head's query heads in passes of at most four, each pass through the family's register-blocked
// kernel for its head count where it has one (simd.h), else the plain loops: every head's lanes are
// computed on their own, so the passes give the same bits as one loop over the group. A run of
// kScoreRows rows that read one block takes the family's rows kernel: their scores' fma chains in
// flight together (one row's few chains wait on the fma latency), each chain the one a row alone runs.
template <typename T>
struct HeadPasses {
  static constexpr int64_t kHeads = 4;
  int64_t group, d, bs;
  ScoresFn<T> scores_fn[kHeads + 1];  // by the pass's head count
  RowsScoresFn<T> rows_fn[kHeads + 1];
  ValuesFn<T> values_fn[kHeads + 1];

  explicit HeadPasses(const Step& s) : group(s.heads / s.kv_heads), d(s.head_dim), bs(s.block_size) {
    for (int64_t g = 1; g <= kHeads; ++g) {
      scores_fn[g] = scores_kernel<T>(bs, g);
      rows_fn[g] = rows_scores_kernel<T>(bs, g);
      values_fn[g] = values_kernel<T>(d, g);
    }
  }
  // sc [group][bs] = the scaled scores of the group's queries qr [group][d] against the block's keys kt
  void scores(const float* qr, const T* kt, int64_t n, float scale, float* sc) const {
    for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const int64_t heads = std::min(kHeads, group - g0);
      if (scores_fn[heads] != nullptr) {
        scores_fn[heads](qr + g0 * d, d, kt, scale, sc + g0 * bs);
      } else {
        plain_scores(qr + g0 * d, heads, d, kt, bs, n, scale, sc + g0 * bs);
      }
    }
  }
  // The same for a run of rows reading one block: row c's queries at q + c * q_stride, its n[c] scores
  // at sc + c * group * bs.
  void run_scores(const float* q, int64_t q_stride, int64_t rows, const T* kt, const int64_t* n, float scale, float* sc) const {
    for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const int64_t heads = std::min(kHeads, group - g0);
      if (rows == kScoreRows && rows_fn[heads] != nullptr) {
        rows_fn[heads](q + g0 * d, q_stride, d, kt, scale, sc + g0 * bs, group * bs);
        continue;
      }
      for (int64_t c = 0; c < rows; ++c) {
        const float* qr = q + c * q_stride + g0 * d;
        float* sr = sc + c * group * bs + g0 * bs;
        if (scores_fn[heads] != nullptr) {
          scores_fn[heads](qr, d, kt, scale, sr);
        } else {
          plain_scores(qr, heads, d, kt, bs, n[c], scale, sr);
        }
      }
    }
  }
  // acc [group][d] += the probabilities sc [group][bs] times the block's n values v
  void values(const float* sc, const T* v, int64_t stride, int64_t n, float* acc) const {
    for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const int64_t heads = std::min(kHeads, group - g0);
      if (values_fn[heads] != nullptr) {
        values_fn[heads](sc + g0 * bs, v, stride, n, acc + g0 * d, bs);
      } else {
        plain_values(sc + g0 * bs, v, stride, n, heads, d, bs, acc + g0 * d);
      }
    }
  }
};

// sum[c] = the sum of chain c's n[c] values a[c][0..n), added in order from 0.f; eight chains at a time
// over their common length, so their add chains overlap (written out: GCC turned the same loop over a
// variable count into gathers, slower on the Zen 3), each chain's tail after it, the order unchanged.
inline void ordered_sums(const float* const* a, const int64_t* n, int64_t chains, float* sum) {
  int64_t c = 0;
  for (; c + 8 <= chains; c += 8) {
    const float *a0 = a[c], *a1 = a[c + 1], *a2 = a[c + 2], *a3 = a[c + 3], *a4 = a[c + 4], *a5 = a[c + 5], *a6 = a[c + 6],
                *a7 = a[c + 7];
    const int64_t common = *std::min_element(n + c, n + c + 8);
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f, s6 = 0.f, s7 = 0.f;
    for (int64_t t = 0; t < common; ++t) {
      s0 += a0[t], s1 += a1[t], s2 += a2[t], s3 += a3[t];
      s4 += a4[t], s5 += a5[t], s6 += a6[t], s7 += a7[t];
    }
    sum[c] = s0, sum[c + 1] = s1, sum[c + 2] = s2, sum[c + 3] = s3;
    sum[c + 4] = s4, sum[c + 5] = s5, sum[c + 6] = s6, sum[c + 7] = s7;
    for (int64_t k = c; k < c + 8; ++k)
      for (int64_t t = common; t < n[k]; ++t) sum[k] += a[k][t];
  }
  for (; c + 4 <= chains; c += 4) {
    const float *a0 = a[c], *a1 = a[c + 1], *a2 = a[c + 2], *a3 = a[c + 3];
    const int64_t common = *std::min_element(n + c, n + c + 4);
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int64_t t = 0; t < common; ++t) s0 += a0[t], s1 += a1[t], s2 += a2[t], s3 += a3[t];
    sum[c] = s0, sum[c + 1] = s1, sum[c + 2] = s2, sum[c + 3] = s3;
    for (int64_t k = c; k < c + 4; ++k)
      for (int64_t t = common; t < n[k]; ++t) sum[k] += a[k][t];
  }
  for (; c < chains; ++c) {
    float s = 0.f;
    for (int64_t t = 0; t < n[c]; ++t) s += a[c][t];
    sum[c] = s;
  }
}

// One block's scores of a run of rows (row c's n[c] per query head, at sc + c * group * bs) folded
// into each row's running softmax (row c's m, l and acc at c * group, c * group, c * group * d): the
// new max, the scores turned into exp(score - max) in place, the sum and the accumulator rescaled. Each
// head's sum runs over t in order (ordered_sums), and a rescale of exactly 1 (the max unchanged, as in
// most blocks past the first) is skipped: x * 1 is x.
inline void online_softmax(float* sc, int64_t rows, const int64_t* n, int64_t group, int64_t d, int64_t bs, float* m, float* l,
                           float* acc, float* top, float* sum) {
  constexpr int64_t kMaxChains = 64;
  const float* chain[kMaxChains];
  int64_t length[kMaxChains];
  for (int64_t c0 = 0; c0 < rows * group; c0 += kMaxChains) {
    const int64_t chains = std::min(kMaxChains, rows * group - c0);
    for (int64_t k = 0; k < chains; ++k) {
      const int64_t c = c0 + k, r = c / group, count = n[r];
      float* sg = sc + c * bs;  // row r's head c % group: rows' scores lie one after another
      float best = m[c];
#pragma omp simd reduction(max : best)
      for (int64_t t = 0; t < count; ++t) best = sg[t] > best ? sg[t] : best;
#pragma omp simd
      for (int64_t t = 0; t < count; ++t) sg[t] = exp_fp32(sg[t] - best);
      top[c] = best;
      chain[k] = sg;
      length[k] = count;
    }
    ordered_sums(chain, length, chains, sum + c0);
  }
  for (int64_t c = 0; c < rows * group; ++c) {
    if (top[c] == m[c]) {
      l[c] += sum[c];
      continue;
    }
    const float rescale = exp_fp32(m[c] - top[c]);
    l[c] = l[c] * rescale + sum[c];
    m[c] = top[c];
    float* a = acc + c * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
  }
}

// Rows r0 .. r1 - 1 of KV head h: the blocks walked in order, so rows that share blocks (a prefill
// chunk's rows, decodes under one system prompt) read each block while it is in cache. At each block
// the rows go in runs of up to kScoreRows consecutive rows that read it from the same pool block (a
// prefill chunk's rows are one sequence's).
template <typename T>
void attend_rows(const Step& s, const float* q, const T* k_pool, const T* v_pool, int64_t h, int64_t r0, int64_t r1,
                 const HeadPasses<T>& passes, Softmax& st, float* out) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size, slot_stride = s.kv_heads * d;
  st.reset();
  int64_t blocks = 0;
  for (int64_t r = r0; r < r1; ++r) blocks = std::max(blocks, (s.positions[r] + bs) / bs);
  auto block_of = [&](int64_t r, int64_t j) { return s.tables[s.row_seq[r] * s.max_blocks + j]; };
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t start = j * bs;
    for (int64_t r = r0; r < r1;) {
      if (start > s.positions[r]) {
        ++r;
        continue;
      }
      const int64_t block = block_of(r, j);
      int64_t n[kScoreRows], rows = 0;
      for (; rows < kScoreRows && r + rows < r1; ++rows) {
        const int64_t c = r + rows;
        if (start > s.positions[c] || block_of(c, j) != block) break;
        n[rows] = std::min(bs, s.positions[c] + 1 - start);
      }
      const T* kt = k_pool + (block * s.kv_heads + h) * d * bs;  // this block's keys of head h, [d][bs]
      const T* v = v_pool + block * bs * slot_stride + h * d;
      const int64_t rr = r - r0;
      passes.run_scores(q + (r * s.heads + h * group) * d, s.heads * d, rows, kt, n, s.scale, st.sc.data());
      online_softmax(st.sc.data(), rows, n, group, d, bs, &st.m[rr * group], &st.l[rr * group], &st.acc[rr * group * d],
                     st.top.data(), st.sum.data());
      for (int64_t c = 0; c < rows; ++c)
        passes.values(&st.sc[c * group * bs], v, slot_stride, n[c], &st.acc[(rr + c) * group * d]);
      r += rows;
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t i0 = (r - r0) * group + g;
      const float inv = st.l[i0] > 0.f ? 1.f / st.l[i0] : 0.f;
      float* o = out + (r * s.heads + h * group + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = st.acc[i0 * d + i] * inv;
    }
}

// out [T, H, D] = attention of every row of q [T, H, D] over its own context (positions 0..pos), read in
// place from the pool. Work is split by KV head and by chunks of rows, each chunk walking its blocks in
// order: a block's keys and values are read once per chunk, so the chunk is as long as keeps at least
// kItems pieces of work for the threads (a 135 M model's 3 KV heads at 16,384 tokens of context: 16
// rows a chunk 585, 64 rows 392 ns a row, block and KV head, on one Zen 4 core, the pool streaming
// from memory). A row's arithmetic does not depend on the other rows or on the chunk's length.
template <typename T>
void attend(const Step& s, const float* q, const T* k_pool, const T* v_pool, float* out) {
  constexpr int64_t kMinRows = 16, kMaxRows = 128, kItems = 16;
  int64_t rows = kMaxRows;
  while (rows > kMinRows && s.kv_heads * ((s.tokens + rows - 1) / rows) < kItems) rows /= 2;
  const int64_t chunks = (s.tokens + rows - 1) / rows;
  const HeadPasses<T> passes(s);
  parallel_for(0, s.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    Softmax st(rows, kScoreRows, passes.group, s.head_dim, s.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % s.kv_heads, r0 = (item / s.kv_heads) * rows;
      attend_rows(s, q, k_pool, v_pool, h, r0, std::min(s.tokens, r0 + rows), passes, st, out);
    }
  });
}

// The fewest of n probabilities whose sum reaches `mass`, largest first: where a descending sort's
// running sum first reaches it (n + 1 where it never does), found by selection instead of a sort. Each
// pass splits the candidates around one of them into larger, equal and smaller (v is reordered), and
// either keeps to the larger ones, which hold the mass, or takes them and the equal ones whole.
inline int64_t fewest_for_mass(float* v, int64_t n, double mass) {
  int64_t taken = 0, lo = 0, hi = n;
  while (lo < hi) {
    const float pivot = v[lo + (hi - lo) / 2];
    int64_t gt = lo, eq = lo, end = hi;  // [lo, gt) larger, [gt, eq) equal, [end, hi) smaller
    while (eq < end) {
      if (v[eq] > pivot) {
        std::swap(v[gt++], v[eq++]);
      } else if (v[eq] < pivot) {
        std::swap(v[eq], v[--end]);
      } else {
        ++eq;
      }
    }
    double larger = 0.0;
    for (int64_t i = lo; i < gt; ++i) larger += v[i];
    if (larger >= mass) {
      hi = gt;
      continue;
    }
    mass -= larger;
    taken += gt - lo;
    const double equal = static_cast<double>(eq - gt) * pivot;
    if (pivot > 0.f && equal >= mass) return taken + std::max<int64_t>(1, static_cast<int64_t>(std::ceil(mass / pivot)));
    mass -= equal;
    taken += eq - gt;
    lo = eq;
  }
  return taken + 1;
}

// kv_sparsity's sample of row r (layers/attention.py attention_coverage, the PyTorch step's): per
// query head, the fewest context positions that hold `mass` of its attention (the softmax of its
// scaled scores over the row's whole context, read from the pool), as a share of the context, averaged
// over the heads.
template <typename T>
float coverage(const Step& s, const float* q, const T* k_pool, int64_t r, double mass) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size, ctx = s.positions[r] + 1;
  std::vector<float> sc(group * bs), p(group * ctx);
  double total = 0.0;
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    const float* qr = q + (r * s.heads + h * group) * d;
    for (int64_t j = 0; j * bs < ctx; ++j) {
      const int64_t n = std::min(bs, ctx - j * bs), block = s.tables[s.row_seq[r] * s.max_blocks + j];
      plain_scores(qr, group, d, k_pool + (block * s.kv_heads + h) * d * bs, bs, n, s.scale, sc.data());
      for (int64_t g = 0; g < group; ++g) std::memcpy(&p[g * ctx + j * bs], &sc[g * bs], n * sizeof(float));
    }
    for (int64_t g = 0; g < group; ++g) {
      float* pg = &p[g * ctx];
      const float top = *std::max_element(pg, pg + ctx);
      double sum = 0.0;
      for (int64_t t = 0; t < ctx; ++t) sum += (pg[t] = exp_fp32(pg[t] - top));
      for (int64_t t = 0; t < ctx; ++t) pg[t] = static_cast<float>(pg[t] / sum);
      total += std::min(1.0, static_cast<double>(fewest_for_mass(pg, ctx, mass)) / ctx);
    }
  }
  return static_cast<float>(total / s.heads);
}

// qkv [T, (H + 2 KVH) D] -> q rotated into `q` [T, H, D]; k rotated and v written at each row's slot
// (q_norm, k_norm: Qwen3's per-head norms before rotation, or nullptr).
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
      if (norm != nullptr) rms_norm(xh, norm, 1, d, s.eps, xh);
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

}  // namespace stratum_step
