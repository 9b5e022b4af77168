// The model's whole forward for one step, every layer in one call: RMSNorm, the projections on the packed
// blocks, rotary, the write into the paged KV pool, attention read in place, SwiGLU and the residual.
//
// Batch invariance: every output of every row is computed by the same sequence of operations whatever
// else is in the batch: the activation scales are per row, integer sums are exact, the fp32
// accumulation runs over blocks in a fixed order per output lane, and attention walks each row's blocks
// in order with its own online softmax. A token therefore gets the same logits alone, in a batch of 64,
// or after a prefix-cache hit, and prefill writes the same KV a decode would.
#pragma once

#include <array>

#include "attention.h"
#include "projection.h"

namespace stratum_step {

struct LayerWeights {
  const float* in_norm;    // [hidden]
  const float* post_norm;  // [hidden]
  const float* bias;       // the qkv bias [qkv rows], or nullptr
  const float* q_norm;     // Qwen3's per-head norms [head_dim], or nullptr
  const float* k_norm;
  std::array<Projection, 4> proj;  // qkv, o, gate_up, down
};

// The rows whose attention coverage (kv_sparsity's sample, attention.h `coverage`) is measured at some
// layers: out [num_layers][num_rows].
struct Probes {
  const int64_t* layers;
  int64_t num_layers;
  const int64_t* rows;
  int64_t num_rows;
  double mass;
  float* out;
};

// The step's intermediate rows, for `tokens` rows of a model.
struct Activations {
  Buffer h, qkv, q, attn, proj, gu, act;
  QuantRows xq;
  Activations(int64_t tokens, int64_t hidden, int64_t q_size, int64_t qkv_size, int64_t inter, int activation_bits)
      : h(tokens * hidden), qkv(tokens * qkv_size), q(tokens * q_size), attn(tokens * q_size), proj(tokens * hidden),
        gu(tokens * 2 * inter), act(tokens * inter), xq(activation_bits) {}
};

// SwiGLU: act = silu(gate) * up, gu's rows [gate | up] of `inter` each.
inline void swiglu(const float* gu, int64_t tokens, int64_t inter, float* act) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gt = gu + t * 2 * inter;
    float* at = act + t * inter;
#pragma omp simd  // a vector exp: a scalar one per value cost more than the projections at 32 rows
    for (int64_t i = 0; i < inter; ++i) at[i] = gt[i] / (1.f + exp_fp32(-gt[i])) * gt[inter + i];
  }
}

template <typename T>
void probe_coverage(const Step& s, const Probes& probes, int64_t layer, const float* q, const T* k_pool) {
  for (int64_t p = 0; p < probes.num_layers; ++p)
    if (probes.layers[p] == layer)
      for (int64_t i = 0; i < probes.num_rows; ++i) probes.out[p * probes.num_rows + i] = coverage(s, q, k_pool, probes.rows[i], probes.mass);
}

// One decoder layer on the residual stream x [T, hidden], in place.
template <typename T>
void layer_forward(const Step& s, const LayerWeights& w, int64_t layer, int64_t inter, T* k_pool, T* v_pool, const Probes& probes,
                   float* x, Activations& a) {
  const int64_t tokens = s.tokens, hidden = s.hidden;
  const int64_t q_size = s.heads * s.head_dim, qkv_size = (s.heads + 2 * s.kv_heads) * s.head_dim;
  rms_norm(x, w.in_norm, tokens, hidden, s.eps, a.h.get());
  a.xq.quantize(a.h.get(), tokens, hidden);
  linear(w.proj[0], a.xq, tokens, a.qkv.get());
  if (w.bias != nullptr)
    for (int64_t t = 0; t < tokens; ++t) add_into(a.qkv.get() + t * qkv_size, w.bias, qkv_size);
  rotate_and_store(s, a.qkv.get(), w.q_norm, w.k_norm, a.q.get(), k_pool, v_pool);
  attend(s, a.q.get(), k_pool, v_pool, a.attn.get());
  probe_coverage(s, probes, layer, a.q.get(), k_pool);
  a.xq.quantize(a.attn.get(), tokens, q_size);
  linear(w.proj[1], a.xq, tokens, a.proj.get());
  add_into(x, a.proj.get(), tokens * hidden);
  rms_norm(x, w.post_norm, tokens, hidden, s.eps, a.h.get());
  a.xq.quantize(a.h.get(), tokens, hidden);
  linear(w.proj[2], a.xq, tokens, a.gu.get());
  swiglu(a.gu.get(), tokens, inter, a.act.get());
  a.xq.quantize(a.act.get(), tokens, inter);
  linear(w.proj[3], a.xq, tokens, a.proj.get());
  add_into(x, a.proj.get(), tokens * hidden);
}

// x [T, hidden] fp32, the embedded tokens, updated in place as the residual stream; out [T, hidden]: the
// final-normed hidden states. k_pools, v_pools: one pool per layer. activation_bits: 16 or 8 (QuantRows). The caller checks every shape and
// that each row's slot and blocks lie in the pool (packed_step.cpp).
template <typename T>
void forward(const Step& s, const std::vector<LayerWeights>& layers, const float* final_norm, T* const* k_pools,
             T* const* v_pools, const Probes& probes, int activation_bits, float* x, float* out) {
  const int64_t q_size = s.heads * s.head_dim, qkv_size = (s.heads + 2 * s.kv_heads) * s.head_dim;
  const int64_t inter = layers[0].proj[3][0].in_features();
  Activations a(s.tokens, s.hidden, q_size, qkv_size, inter, activation_bits);
  for (size_t l = 0; l < layers.size(); ++l)
    layer_forward(s, layers[l], static_cast<int64_t>(l), inter, k_pools[l], v_pools[l], probes, x, a);
  rms_norm(x, final_norm, s.tokens, s.hidden, s.eps, out);
}

}  // namespace stratum_step
