// specviz::w8a8_token_linear: W8A8TokenLinear's forward as one operator.
//
// The Python forward of specviz.models.weights.W8A8TokenLinear spends about 25 small
// operators per layer on quantizing its input per token and rescaling fbgemm's output;
// on a 2-core CPU those cost as much as the integer product of a one-token forward.
// This operator does the same arithmetic in three passes over each row (smooth and take
// the row's range; round to codes and take the residual's range; round the residual)
// and one pass over the output, around the same fbgemm product (the packed weight's
// apply_dynamic, what quantized::linear_dynamic calls).
//
// Rows are processed independently, in any order and on any thread, with the same
// instructions for every row: a token's output does not depend on the other rows of its
// forward, which is what keeps speculative verification on plain decoding's path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float kCodes = 127.0f;   // activation codes lie in [-127, 127]
constexpr float kRange = 127.5f;   // the two constant columns: fbgemm's scale is exactly 1

// The largest |p[i]|, eight lanes at a time (a maximum is exact in any order).
float absmax(const float* p, int64_t k) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float m = 0.0f;
  for (float v : lanes) m = std::max(m, v);
  for (; i < k; ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

at::Tensor w8a8_token_linear(const at::Tensor& x, const at::Tensor& inv_smooth,
                             const c10::intrusive_ptr<LinearPackedParamsBase>& packed,
                             const std::optional<at::Tensor>& bias, bool residual) {
  TORCH_CHECK(x.device().is_cpu() && inv_smooth.device().is_cpu(), "w8a8_token_linear runs on the CPU");
  TORCH_CHECK(inv_smooth.dim() == 1 && inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous(),
              "inv_smooth must be a contiguous float32 vector");
  const int64_t k = inv_smooth.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input's last dimension is ", x.size(-1), ", the layer takes ", k);
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();  // (M, K)
  const int64_t m = x2.size(0);
  const int64_t passes = residual ? 2 : 1;
  const int64_t width = k + 2;
  at::Tensor fed = at::empty({passes * m, width}, x2.options());  // (P*M, K + 2)
  std::vector<float> step(m), step2(m);
  const float* xs = x2.data_ptr<float>();
  const float* smooth = inv_smooth.data_ptr<float>();
  float* f = fed.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * k;
      float* codes = f + r * width;
      for (int64_t i = 0; i < k; ++i) t[i] = xr[i] * smooth[i];  // smoothed
      const float amax = std::max(absmax(t.data(), k), 1e-30f);
      const float scale = (1.0f / amax) * kCodes;  // as torch computes 127 / tensor
      for (int64_t i = 0; i < k; ++i) {
        const float v = t[i] * scale;
        const float c = std::nearbyint(v);  // round half to even, as torch.round
        codes[i] = c;
        t[i] = v - c;  // rounding error in codes, |e| <= 1/2
      }
      codes[k] = kRange;
      codes[k + 1] = -kRange;
      step[r] = amax / kCodes;
      if (residual) {
        float* rest = f + (m + r) * width;
        const float emax = std::max(absmax(t.data(), k), 1e-30f);
        const float scale2 = (1.0f / emax) * kCodes;
        for (int64_t i = 0; i < k; ++i) {
          rest[i] = std::nearbyint(t[i] * scale2);
        }
        rest[k] = kRange;
        rest[k + 1] = -kRange;
        step2[r] = step[r] * (emax / kCodes);
      }
    }
  });
  at::Tensor y = packed->apply_dynamic(fed, /*reduce_range=*/false);  // (P*M, N) exact products x w_scale
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == passes * m, "unexpected product shape");
  y = y.contiguous();
  const int64_t n = y.size(1);
  at::Tensor out = residual ? at::empty({m, n}, y.options()) : y;  // (M, N)
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "bias has ", b.numel(), " entries for ", n, " outputs");
    bp = b.data_ptr<float>();
  }
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* y0 = yp + r * n;
      const float* y1 = residual ? yp + (m + r) * n : nullptr;
      float* o = op + r * n;
      const float s = step[r];
      // Each product and sum rounded on its own, as the PyTorch code's separate operators
      // (no fused multiply-add, whose use would depend on how a library was compiled).
      if (residual) {
        const float s2 = step2[r];
        if (bp) {
          for (int64_t j = 0; j < n; ++j) o[j] = (y0[j] * s + y1[j] * s2) + bp[j];
        } else {
          for (int64_t j = 0; j < n; ++j) o[j] = y0[j] * s + y1[j] * s2;
        }
      } else if (bp) {
        for (int64_t j = 0; j < n; ++j) o[j] = y0[j] * s + bp[j];
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = y0[j] * s;
      }
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(specviz, m) {
  m.def("w8a8_token_linear(Tensor x, Tensor inv_smooth, "
        "__torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor? bias, bool residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(specviz, CPU, m) {
  m.impl("w8a8_token_linear", TORCH_FN(w8a8_token_linear));
}
