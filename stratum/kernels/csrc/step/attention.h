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
// and the unnormalized output acc; sc holds one block's scores of the current row.
struct Softmax {
  std::vector<float> acc, m, l, sc;
  Softmax(int64_t rows, int64_t group, int64_t d, int64_t bs) : acc(rows * group * d), m(rows * group), l(rows * group), sc(group * bs) {}
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
// computed on their own, so the passes give the same bits as one loop over the group.
template <typename T>
struct HeadPasses {
  static constexpr int64_t kHeads = 4;
  int64_t group, d, bs;
  ScoresFn<T> scores_fn[kHeads + 1];  // by the pass's head count
  ValuesFn<T> values_fn[kHeads + 1];

  explicit HeadPasses(const Step& s) : group(s.heads / s.kv_heads), d(s.head_dim), bs(s.block_size) {
    for (int64_t g = 1; g <= kHeads; ++g) {
      scores_fn[g] = scores_kernel<T>(bs, g);
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

// One block's scores (n of them per query head, in sg) folded into a row's running softmax: the new
// max, the scores turned into exp(score - max) in place, the sum and the accumulator rescaled. Each
// head's sum runs over t in order; four heads' sums are interleaved so their add chains overlap (written
// out for four: GCC turned the same loop over a variable count into gathers, slower on the Zen 3), and
// a rescale of exactly 1 (the max unchanged, as in most blocks past the first) is skipped: x * 1 is x.
inline void online_softmax(float* sc, int64_t n, int64_t group, int64_t d, int64_t bs, float* m, float* l, float* acc) {
  constexpr int64_t kChains = 4;
  for (int64_t g0 = 0; g0 < group; g0 += kChains) {
    const int64_t heads = std::min(kChains, group - g0);
    float new_m[kChains], sum[kChains] = {};
    for (int64_t g = 0; g < heads; ++g) {
      float* sg = sc + (g0 + g) * bs;
      float top = m[g0 + g];
#pragma omp simd reduction(max : top)
      for (int64_t t = 0; t < n; ++t) top = sg[t] > top ? sg[t] : top;
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) sg[t] = exp_fp32(sg[t] - top);
      new_m[g] = top;
    }
    if (heads == kChains) {
      const float* a = sc + g0 * bs;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s0 += a[t];
        s1 += a[bs + t];
        s2 += a[2 * bs + t];
        s3 += a[3 * bs + t];
      }
      sum[0] = s0, sum[1] = s1, sum[2] = s2, sum[3] = s3;
    } else {
      for (int64_t g = 0; g < heads; ++g)
        for (int64_t t = 0; t < n; ++t) sum[g] += sc[(g0 + g) * bs + t];
    }
    for (int64_t g = 0; g < heads; ++g) {
      if (new_m[g] == m[g0 + g]) {
        l[g0 + g] += sum[g];
        continue;
      }
      const float rescale = exp_fp32(m[g0 + g] - new_m[g]);
      l[g0 + g] = l[g0 + g] * rescale + sum[g];
      m[g0 + g] = new_m[g];
      float* a = acc + (g0 + g) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
    }
  }
}

// Rows r0 .. r1 - 1 of KV head h: the blocks walked in order, so rows that share blocks (a prefill
// chunk's rows, decodes under one system prompt) read each block while it is in cache.
template <typename T>
void attend_rows(const Step& s, const float* q, const T* k_pool, const T* v_pool, int64_t h, int64_t r0, int64_t r1,
                 const HeadPasses<T>& passes, Softmax& st, float* out) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, bs = s.block_size, slot_stride = s.kv_heads * d;
  st.reset();
  int64_t blocks = 0;
  for (int64_t r = r0; r < r1; ++r) blocks = std::max(blocks, (s.positions[r] + bs) / bs);
  for (int64_t j = 0; j < blocks; ++j) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ctx = s.positions[r] + 1, start = j * bs;
      if (start >= ctx) continue;
      const int64_t n = std::min(bs, ctx - start), rr = r - r0;
      const int64_t block = s.tables[s.row_seq[r] * s.max_blocks + j];
      const T* kt = k_pool + (block * s.kv_heads + h) * d * bs;  // this block's keys of head h, [d][bs]
      const T* v = v_pool + block * bs * slot_stride + h * d;
      const float* qr = q + (r * s.heads + h * group) * d;
      float* acc = &st.acc[rr * group * d];
      passes.scores(qr, kt, n, s.scale, st.sc.data());
      online_softmax(st.sc.data(), n, group, d, bs, &st.m[rr * group], &st.l[rr * group], acc);
      passes.values(st.sc.data(), v, slot_stride, n, acc);
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
// place from the pool. Work is split by KV head and by chunks of 16 rows; a row's arithmetic does not
// depend on the other rows.
template <typename T>
void attend(const Step& s, const float* q, const T* k_pool, const T* v_pool, float* out) {
  constexpr int64_t kRows = 16;
  const int64_t chunks = (s.tokens + kRows - 1) / kRows;
  const HeadPasses<T> passes(s);
  parallel_for(0, s.kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    Softmax st(kRows, passes.group, s.head_dim, s.block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % s.kv_heads, r0 = (item / s.kv_heads) * kRows;
      attend_rows(s, q, k_pool, v_pool, h, r0, std::min(s.tokens, r0 + kRows), passes, st, out);
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
