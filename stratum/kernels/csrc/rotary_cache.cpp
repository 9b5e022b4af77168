// Rotary embedding of q and k and the write of k and v into the paged pool, in one pass.
//
// In PyTorch this is a dozen small ops per layer (casts, halves, products, a concatenation, two
// indexed stores); at one decode token each costs more in dispatch than in arithmetic. Same math as
// layers/rotary.apply_rotary: rotate-half in fp32, rounded once to the activation dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

template <typename T>
void rotary_cache_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, at::Tensor& qk) {
  const int64_t tokens = qkv.size(0), num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2), half = head_dim / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const T* in = qkv.data_ptr<T>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* out = qk.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t kv_row = num_kv_heads * head_dim;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = in + t * row;
      const float* ct = c + t * half;
      const float* st = s + t * half;
      T* o = out + t * (num_heads + num_kv_heads) * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const T* xh = x + h * head_dim;
        T* oh = o + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
          oh[i] = static_cast<T>(x1 * ct[i] - x2 * st[i]);
          oh[i + half] = static_cast<T>(x2 * ct[i] + x1 * st[i]);
        }
      }
      std::copy(o + num_heads * head_dim, o + (num_heads + num_kv_heads) * head_dim, kc + sl[t] * kv_row);
      std::copy(x + (num_heads + num_kv_heads) * head_dim, x + row, vc + sl[t] * kv_row);
    }
  });
}

// qkv [T, (H + 2 KVH) D]; cos, sin [T, D/2] fp32; k_cache, v_cache [S, KVH, D] in qkv's dtype; slots [T]
// int64. Returns q and k rotated, [T, H + KVH, D]; writes rotated k and v at each token's slot.
at::Tensor rotary_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "rotary_cache: bad shapes");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type(),
              "rotary_cache: qkv and the pool must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rotary_cache: the pool must be contiguous");
  const int64_t tokens = qkv.size(0), num_kv_heads = k_cache.size(1), head_dim = k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0, "rotary_cache: head mismatch");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == tokens * head_dim / 2 &&
              sin.numel() == cos.numel(), "rotary_cache: cos and sin must be [T, D/2] fp32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens, "rotary_cache: one int64 slot per token");
  const auto sc = slots.contiguous();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = sc.data_ptr<int64_t>()[t];
    TORCH_CHECK(slot >= 0 && slot < k_cache.size(0), "rotary_cache: slot ", slot, " outside the pool");
  }
  const auto x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  auto qk = at::empty({tokens, num_heads + num_kv_heads, head_dim}, qkv.options());
  switch (qkv.scalar_type()) {
    case at::kFloat: rotary_cache_impl<float>(x, c, s, k_cache, v_cache, sc, num_heads, qk); break;
    case at::kBFloat16: rotary_cache_impl<c10::BFloat16>(x, c, s, k_cache, v_cache, sc, num_heads, qk); break;
    case at::kHalf: rotary_cache_impl<c10::Half>(x, c, s, k_cache, v_cache, sc, num_heads, qk); break;
    default: TORCH_CHECK(false, "rotary_cache: unsupported dtype ", qkv.scalar_type());
  }
  return qk;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("rotary_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int num_heads) -> Tensor");
  m.impl("rotary_cache", c10::DispatchKey::CPU, TORCH_FN(rotary_cache));
}
