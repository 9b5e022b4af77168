// The native step's torch operators: the model's whole forward on the GGUF's packed weights as one call
// per step, and one packed projection. This file checks the tensors and hands raw pointers to the
// torch-free kernels in step/ (docs/kernels.md):
//   numerics.h    constants, fp16/bf16, exp, the int16 activations, RMSNorm, threads: why every path agrees
//   formats.h     the tile formats, with a drawing of each block layout, and how each is read
//   simd.h        the SIMD family the compiler was told of, one file each: simd_avx512.h, simd_avx2.h,
//                 simd_neon.h, simd_portable.h
//   projection.h  x @ w^T on the tiles, one code for every format and family
//   attention.h   rotary, the pool write and paged attention
//   forward.h     the layers in order
//
// Why one call: a step in PyTorch is ~600 operator calls (each a few microseconds of dispatch at one
// decode token) and its int4 kernel reads weights at a fraction of the memory bandwidth. Here one call
// runs every layer, with threads inside and without the Python interpreter.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#define STRATUM_TORCH 1  // numerics.h: ATen's thread pool
#include "step/forward.h"

namespace {

using namespace stratum_step;

// One segment's tensors: data [tiles, blocks, block_bytes] uint8, scales (formats.h) -> a Packed.
Packed packed_of(const at::Tensor& data, const at::Tensor& scales, int64_t format, int64_t rows) {
  TORCH_CHECK(is_format(format), "packed weight: unknown format ", format);
  const auto f = static_cast<Format>(format);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.is_contiguous(), "packed weight: uint8 [tiles, blocks, bytes]");
  TORCH_CHECK(data.size(2) == block_bytes(f), "packed weight: format ", format, " has ", block_bytes(f), "-byte tile-blocks, not ",
              data.size(2));
  const int64_t per = super_scales(f) ? kSuper : 1;  // blocks per row of scales
  TORCH_CHECK(data.size(1) % per == 0, "packed weight: format ", format, " takes whole super-blocks of ", per * kBlock, " inputs");
  TORCH_CHECK(scales.scalar_type() == (super_scales(f) ? at::kByte : at::kHalf) && scales.dim() == 3 && scales.is_contiguous() &&
              scales.size(0) == data.size(0) && scales.size(1) == data.size(1) / per && scales.size(2) == block_scales(f) * per,
              "packed scales do not match the weight's format ", format);
  TORCH_CHECK(rows > (data.size(0) - 1) * kTile && rows <= data.size(0) * kTile, "packed weight: ", rows, " rows in ",
              data.size(0), " tiles");
  return {data.data_ptr<uint8_t>(), scales.data_ptr(), data.size(0), data.size(1), rows, f};
}

void check_inputs(const Projection& w, int64_t k, const char* what) {
  for (const auto& s : w)
    TORCH_CHECK(s.in_features() == k, what, ": input has ", k, " features, the weight ", s.in_features());
}

// An fp32 [n] row of a stacked [L, n] tensor, or nullptr when the model has none (an empty tensor).
const float* row_of(const at::Tensor& t, int64_t layer, int64_t layers, int64_t n, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == at::IntArrayRef({layers, n}),
              "packed_forward: ", what, " must be [L, ", n, "] fp32");
  return t.data_ptr<float>() + layer * n;
}

// The step's weights from the list PackedStack.weights passes, in this order: in_norm, post_norm [L,
// hidden], final_norm [hidden], qkv bias [L, n], q/k norms [L, D] (fp32, or empty), then every layer's
// projections (qkv, o, gate_up, down) as (data, scales) pairs of their segments; `layout` gives, per
// layer and projection, the number of segments and each one's (format, rows).
std::vector<LayerWeights> layers_of(at::TensorList w, at::IntArrayRef layout, const Step& s) {
  TORCH_CHECK(w.size() >= 6, "packed_forward: norms, bias and q/k norms expected first");
  const int64_t num_layers = w[0].size(0), qkv_size = (s.heads + 2 * s.kv_heads) * s.head_dim;
  for (const auto& norm : {w[0], w[1]})
    TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.sizes() == at::IntArrayRef({num_layers, s.hidden}),
                "packed_forward: norms [L, hidden] fp32");
  std::vector<LayerWeights> layers;
  size_t t = 6, i = 0;
  auto next = [&]() {
    TORCH_CHECK(i < layout.size(), "packed_forward: the layout ends early");
    return layout[i++];
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    layers.push_back({w[0].data_ptr<float>() + l * s.hidden, w[1].data_ptr<float>() + l * s.hidden, row_of(w[3], l, num_layers, qkv_size, "bias"),
                      row_of(w[4], l, num_layers, s.head_dim, "q_norm"), row_of(w[5], l, num_layers, s.head_dim, "k_norm"), {}});
    for (auto& proj : layers.back().proj) {
      const int64_t segments = next();
      TORCH_CHECK(segments >= 1, "packed_forward: a projection without segments");
      for (int64_t j = 0; j < segments; ++j) {
        const int64_t format = next(), rows = next();
        TORCH_CHECK(t + 2 <= w.size(), "packed_forward: fewer weight tensors than the layout names");
        proj.push_back(packed_of(w[t], w[t + 1], format, rows));
        t += 2;
      }
    }
  }
  TORCH_CHECK(t == w.size() && i == layout.size(), "packed_forward: more weights than the layout names");
  return layers;
}

// Every projection's shape against the model's: outputs, and every segment's inputs.
void check_shapes(const std::vector<LayerWeights>& layers, const Step& s) {
  TORCH_CHECK(!layers.empty(), "packed_forward: no layers");
  const int64_t q_size = s.heads * s.head_dim, qkv_size = (s.heads + 2 * s.kv_heads) * s.head_dim;
  const int64_t inter = layers[0].proj[3][0].in_features();
  for (const auto& w : layers) {
    const auto& p = w.proj;
    TORCH_CHECK(out_features(p[0]) == qkv_size && out_features(p[1]) == s.hidden && out_features(p[2]) == 2 * inter &&
                out_features(p[3]) == s.hidden, "packed_forward: projection shapes do not match the model");
    check_inputs(p[0], s.hidden, "packed_forward qkv");
    check_inputs(p[1], q_size, "packed_forward o");
    check_inputs(p[2], s.hidden, "packed_forward gate_up");
    check_inputs(p[3], inter, "packed_forward down");
  }
}

void check_pool_access(const Step& s, const at::Tensor& tables, int64_t num_slots, int64_t rotary_positions) {
  const int64_t num_blocks = num_slots / s.block_size;
  for (int64_t t = 0; t < s.tokens; ++t) {
    TORCH_CHECK(s.positions[t] >= 0, "packed_forward: negative position");
    TORCH_CHECK(s.positions[t] < rotary_positions, "packed_forward: position beyond the rotary table");
    TORCH_CHECK(s.slots[t] >= 0 && s.slots[t] < num_slots, "packed_forward: slot ", s.slots[t], " outside the pool");
    TORCH_CHECK(s.row_seq[t] >= 0 && s.row_seq[t] < tables.size(0), "packed_forward: row names no block table");
    TORCH_CHECK(s.positions[t] / s.block_size < s.max_blocks, "packed_forward: a context is longer than its block table");
    for (int64_t j = 0; j <= s.positions[t] / s.block_size; ++j) {
      const int64_t block = s.tables[s.row_seq[t] * s.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "packed_forward: block ", block, " outside the pool");
    }
  }
}

void check_pools(at::TensorList k_caches, at::TensorList v_caches, int64_t layers, int64_t kv_heads, int64_t heads) {
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "packed_forward: one K and one V pool per layer");
  TORCH_CHECK(k_caches[0].dim() == 3 && k_caches[0].size(1) == kv_heads && heads % kv_heads == 0, "packed_forward: head mismatch");
  const auto type = k_caches[0].scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "packed_forward: the pool is fp32 or bf16");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() && k_caches[l].sizes() == k_caches[0].sizes() &&
                v_caches[l].sizes() == k_caches[0].sizes() && k_caches[l].scalar_type() == type && v_caches[l].scalar_type() == type,
                "packed_forward: pools must be contiguous and alike");
}

// The call's geometry from its tensors, each checked.
Step step_of(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& slot_mapping, const at::Tensor& tables, const at::Tensor& row_seq, int64_t heads, int64_t kv_heads,
             int64_t head_dim, double eps, int64_t block_size) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "packed_forward: x must be [T, hidden] fp32");
  for (const auto& t : {positions, slot_mapping, row_seq})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == x.size(0), "packed_forward: one int64 per row");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(), "packed_forward: tables [S, N] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat &&
              sin.is_contiguous() && cos.size(-1) == head_dim / 2, "packed_forward: cos/sin [positions, D/2] fp32");
  TORCH_CHECK(block_size > 0, "packed_forward: block_size must be positive");
  return {x.size(0), x.size(1), heads, kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(eps),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))), positions.data_ptr<int64_t>(),
          slot_mapping.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), cos.data_ptr<float>(),
          sin.data_ptr<float>()};
}

template <typename T, typename AtT>
std::vector<T*> pools_of(at::TensorList caches) {
  static_assert(sizeof(T) == sizeof(AtT), "a pool element is read in place");
  std::vector<T*> pools;
  for (const auto& c : caches) pools.push_back(reinterpret_cast<T*>(c.data_ptr<AtT>()));
  return pools;
}

void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits == 16 || bits == 8, op, ": activations are quantized to 16 or 8 bits, not ", bits);
}

// x [T, hidden] fp32 (the embedded tokens), returned as the final-normed hidden states.
// weights: as layers_of reads them. tables [S, max_blocks] int64, row_seq [T]: each row's sequence.
// probe_layers / probe_rows: the attention coverage of these rows at these layers (the share of each
// row's context that holds probe_mass of a head's attention, averaged over the heads) is returned too,
// [len(layers), len(rows)], for the kv_sparsity telemetry.
std::tuple<at::Tensor, at::Tensor> packed_forward(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
                                                  const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& tables,
                                                  const at::Tensor& row_seq, at::TensorList k_caches, at::TensorList v_caches,
                                                  at::TensorList weight_list, at::IntArrayRef layout, int64_t num_heads,
                                                  int64_t num_kv_heads, double eps, int64_t block_size,
                                                  at::IntArrayRef probe_layers, const at::Tensor& probe_rows,
                                                  double probe_mass, int64_t activation_bits) {
  check_bits(activation_bits, "packed_forward");
  TORCH_CHECK(!k_caches.empty() && k_caches[0].dim() == 3, "packed_forward: pools [slots, KV heads, head_dim]");
  const Step s = step_of(x_in, positions, cos, sin, slot_mapping, tables, row_seq, num_heads, num_kv_heads, k_caches[0].size(2),
                         eps, block_size);
  const std::vector<LayerWeights> layers = layers_of(weight_list, layout, s);
  check_shapes(layers, s);
  check_pools(k_caches, v_caches, static_cast<int64_t>(layers.size()), num_kv_heads, num_heads);
  check_pool_access(s, tables, k_caches[0].size(0), cos.size(0));
  const at::Tensor& final_norm = weight_list[2];
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous() && final_norm.numel() == s.hidden,
              "packed_forward: final norm [hidden] fp32");
  const auto rows = probe_rows.to(at::kLong).contiguous();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(rows.data_ptr<int64_t>()[i] >= 0 && rows.data_ptr<int64_t>()[i] < s.tokens, "packed_forward: probe row outside the step");

  auto x = x_in.clone(at::MemoryFormat::Contiguous);
  auto h = at::empty({s.tokens, s.hidden}, x_in.options());
  auto probe_out = at::zeros({static_cast<int64_t>(probe_layers.size()), rows.numel()}, x_in.options());
  const Probes probes{probe_layers.data(), static_cast<int64_t>(probe_layers.size()), rows.data_ptr<int64_t>(), rows.numel(),
                      probe_mass, probe_out.data_ptr<float>()};
  if (k_caches[0].scalar_type() == at::kFloat) {
    const auto k = pools_of<float, float>(k_caches), v = pools_of<float, float>(v_caches);
    forward<float>(s, layers, final_norm.data_ptr<float>(), k.data(), v.data(), probes, activation_bits, x.data_ptr<float>(),
                   h.data_ptr<float>());
  } else {
    const auto k = pools_of<BF16, at::BFloat16>(k_caches), v = pools_of<BF16, at::BFloat16>(v_caches);
    forward<BF16>(s, layers, final_norm.data_ptr<float>(), k.data(), v.data(), probes, activation_bits, x.data_ptr<float>(),
                  h.data_ptr<float>());
  }
  return {h, probe_out};
}

// x [M, K] fp32 -> [M, rows] fp32 through one packed segment (the output projection, and tests).
// x [M, K] fp32 -> [M, sum of rows] = x @ w^T for a projection's segments (`weights`: data, scales of
// each; `layout`: format, rows of each), x quantized once and every segment's tiles shared out among
// the threads together: a large vocabulary's output projection, held in row ranges, in one call.
at::Tensor packed_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef layout, int64_t activation_bits) {
  check_bits(activation_bits, "packed_linear");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "packed_linear: x must be [M, K] fp32");
  TORCH_CHECK(!weights.empty() && weights.size() % 2 == 0 && weights.size() == layout.size(),
              "packed_linear: (data, scales) and (format, rows) per segment");
  Projection w;
  for (size_t i = 0; i < weights.size(); i += 2) w.push_back(packed_of(weights[i], weights[i + 1], layout[i], layout[i + 1]));
  check_inputs(w, x.size(1), "packed_linear");
  const auto xc = x.contiguous();
  QuantRows xq(static_cast<int>(activation_bits));
  xq.quantize(xc.data_ptr<float>(), x.size(0), x.size(1));
  auto out = at::empty({x.size(0), out_features(w)}, x.options());
  linear(w, xq, x.size(0), out.data_ptr<float>());
  return out;
}

std::string packed_simd() { return kSimdPath; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("packed_simd() -> str", &packed_simd);
  m.def("packed_linear(Tensor x, Tensor[] weights, int[] layout, int activation_bits=16) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
  m.def("packed_forward(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor tables, "
        "Tensor row_seq, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] weights, int[] layout, int num_heads, "
        "int num_kv_heads, float eps, int block_size, int[] probe_layers, Tensor probe_rows, float probe_mass=0.9, "
        "int activation_bits=16) -> (Tensor, Tensor)");
  m.impl("packed_forward", c10::DispatchKey::CPU, TORCH_FN(packed_forward));
}
