// Decode attention read in place from the paged KV pool, for CPUs.
//
// The PyTorch path gathers every sequence's context into a contiguous copy before two batched
// matmuls; at 8 sequences of 800 tokens that copy costs more than the attention itself. Here each
// sequence walks its block table and reads K/V where they lie, one block at a time (all heads of a
// slot are contiguous, and the next block is prefetched while one computes),
// with an online softmax (the flash-decoding order: scores of a block, one rescale per block, then
// the weighted V rows). Math is fp32 whatever the pool's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// Below any real score; finite, because the library is built with -ffast-math (no infinities).
constexpr float kNoScore = -1e30f;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * to_float(v[i]);
}

// One block of one sequence's context (n slots at base) folded into its heads' online softmax: scores,
// the running max m and sum l, the accumulators acc rescaled, then the values added.
template <typename T>
inline void block_step(const T* kp, const T* vp, int64_t base, int64_t n, int64_t num_heads, int64_t head_dim, int64_t group,
                       int64_t slot_stride, int64_t block_size, const float* qf, float* scores, float* m, float* l, float* acc) {
  for (int64_t t = 0; t < n; ++t) {  // a slot holds every KV head contiguously: read it once
    const T* k = kp + base + t * slot_stride;
    for (int64_t hq = 0; hq < num_heads; ++hq)
      scores[hq * block_size + t] = dot(&qf[hq * head_dim], k + (hq / group) * head_dim, head_dim);
  }
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    float* s = &scores[hq * block_size];
    float new_m = m[hq];
    for (int64_t t = 0; t < n; ++t) new_m = std::max(new_m, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - new_m);
      sum += s[t];
    }
    const float rescale = std::exp(m[hq] - new_m);  // 0 on the first block
    l[hq] = l[hq] * rescale + sum;
    m[hq] = new_m;
    float* a = &acc[hq * head_dim];
#pragma omp simd
    for (int64_t i = 0; i < head_dim; ++i) a[i] *= rescale;
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* v = vp + base + t * slot_stride;
    for (int64_t hq = 0; hq < num_heads; ++hq)
      axpy(scores[hq * block_size + t], v + (hq / group) * head_dim, &acc[hq * head_dim], head_dim);
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& ctx_lens, int64_t block_size,
                           double scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots

  const int64_t block_elems = block_size * slot_stride;  // one block of one layer's pool, every head
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    // Peaked attention makes exp() underflow into subnormals, which cost ~100x per operation on x86:
    // flush them to zero for the duration of this kernel.
#if defined(__SSE__)
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr(saved_csr | 0x8040);  // FTZ | DAZ
#endif
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores(num_heads * block_size);
    std::vector<float> m(num_heads), l(num_heads);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t i = 0; i < num_heads * head_dim; ++i)
        qf[i] = to_float(qp[b * num_heads * head_dim + i]) * static_cast<float>(scale);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_elems;
        if (start + block_size < len) {  // blocks are scattered: fetch the next one while this one computes
          const int64_t next = table[start / block_size + 1] * block_elems;
          for (int64_t off = 0; off < block_elems; off += 64 / static_cast<int64_t>(sizeof(T))) {
            __builtin_prefetch(kp + next + off);
            __builtin_prefetch(vp + next + off);
          }
        }
        block_step(kp, vp, base, std::min(block_size, len - start), num_heads, head_dim, group, slot_stride, block_size,
                   qf.data(), scores.data(), m.data(), l.data(), acc.data());
      }
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        const int64_t row = b * num_heads + hq;
        const float inv = l[hq] > 0.f ? 1.f / l[hq] : 0.f;
        for (int64_t i = 0; i < head_dim; ++i) op[row * head_dim + i] = acc[hq * head_dim + i] * inv;
        lp[row] = l[hq] > 0.f ? m[hq] + std::log(l[hq]) : kNoScore;
      }
    }
#if defined(__SSE__)
    _mm_setcsr(saved_csr);
#endif
  });
}

// q [B, H, D]; k_cache, v_cache [num_slots, KVH, D] in q's dtype; block_table [B, max_blocks] int64;
// ctx_lens [B] int64 (tokens of each sequence's context, counted from its first table entry).
// Returns out [B, H, D] fp32 and lse [B, H] fp32, the log-sum-exp of each head's scaled scores, so a
// caller can merge it with attention over another part of the context.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                    const at::Tensor& block_table, const at::Tensor& ctx_lens,
                                                    int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "decode_attention: bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and the pool must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "decode_attention: head mismatch");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong, "decode_attention: int64 tables");
  TORCH_CHECK(block_table.size(0) == q.size(0) && ctx_lens.size(0) == q.size(0), "decode_attention: batch mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: the pool must be contiguous");
  auto qc = q.contiguous();
  auto table = block_table.contiguous();
  auto lens = ctx_lens.contiguous();
  const int64_t num_blocks = k_cache.size(0) / block_size;
  for (int64_t b = 0; b < q.size(0); ++b) {  // every block read must lie in the pool
    const int64_t len = lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 0 && len <= table.size(1) * block_size, "decode_attention: a context is longer than its block table");
    for (int64_t j = 0; j * block_size < len; ++j) {
      const int64_t block = table.data_ptr<int64_t>()[b * table.size(1) + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention: block ", block, " outside the pool");
    }
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_attention_impl<float>(qc, k_cache, v_cache, table, lens, block_size, scale, out, lse);
      break;
    case at::kBFloat16:
      decode_attention_impl<c10::BFloat16>(qc, k_cache, v_cache, table, lens, block_size, scale, out, lse);
      break;
    case at::kHalf:
      decode_attention_impl<c10::Half>(qc, k_cache, v_cache, table, lens, block_size, scale, out, lse);
      break;
    default:
      TORCH_CHECK(false, "decode_attention: unsupported dtype ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(stratum, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_lens, "
        "int block_size, float scale) -> (Tensor, Tensor)");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
