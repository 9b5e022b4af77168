// The output projection on GGUF Q8_0 weights as stored: int8 values with one scale per 32, fp32 math.
//
// A Q8_0 block (llama.cpp ggml-common.h, block_q8_0) is value = q * d with q int8 and d fp16. Rounding
// those values to bf16 perturbs the logits enough to flip near-tied top-1 tokens, and fp32 copies read
// twice the bytes of bf16; reading the int8 values and scales directly is exact and reads half. Each
// output keeps 32 lane sums across its blocks (one scale multiply per block) and reduces once. The
// work grows with every input row, so it wins over dense bf16 for the few rows of a small decode batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

constexpr int64_t kGroup = 32;  // QK8_0

// x [M, K] fp32; q [N, K] int8; scales [N, K / 32] fp32. Returns x @ (q * scales)^T, [M, N] fp32.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "q8_linear: x must be [M, K] fp32 on CPU");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == x.size(1) && q.size(1) % kGroup == 0,
              "q8_linear: q must be [N, K] int8 with K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == q.size(0) && scales.size(1) == q.size(1) / kGroup,
              "q8_linear: scales must be [N, K / 32] fp32");
  const auto xc = x.contiguous();
  const auto qc = q.contiguous();
  const auto sc = scales.contiguous();
  const int64_t rows = x.size(0), k_dim = x.size(1), n_dim = q.size(0), groups = k_dim / kGroup;
  auto out = at::empty({rows, n_dim}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n_dim, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = qp + n * k_dim;
      const float* d = sp + n * groups;
      for (int64_t m = 0; m < rows; ++m) {
        const float* xr = xp + m * k_dim;
        float lanes[kGroup] = {0.f};
        for (int64_t g = 0; g < groups; ++g) {
          const float dg = d[g];
#pragma omp simd
          for (int64_t j = 0; j < kGroup; ++j)
            lanes[j] += dg * (xr[g * kGroup + j] * static_cast<float>(w[g * kGroup + j]));
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < kGroup; ++j) sum += lanes[j];
        op[m * n_dim + n] = sum;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stratum, m) {
  m.def("q8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.impl("q8_linear", c10::DispatchKey::CPU, TORCH_FN(q8_linear));
}
