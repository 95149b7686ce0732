// specviz::w8a8_token_linear: W8A8TokenLinear's forward as one operator (and, below,
// specviz::w4a8_token_linear: W4A8TokenLinear's, with 4-bit weights).
//
// The Python forward of specviz.quant.weights.W8A8TokenLinear spends about 25 small
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
//
// On CPUs with AVX-512 VNNI, forwards can take the integer product from a kernel of its
// own instead of fbgemm's (the layer passes its weight in the kernel's layout and the
// largest row count it is for, see vnni_product): it reads each block of weights once
// from memory and multiplies it by every row while the block sits in the cache. One
// 1536 -> 8960 layer held in the cache of a 2-core AMD EPYC, microseconds for 1 / 3 / 6
// tokens (2 / 6 / 12 rows): 145 / 224 / 411, about 400 GMAC/s at 3 tokens and more,
// after its accumulators became named variables (an array of them: 151 / 466 / 869).
// Both products are exact integers, rescaled with the same single float rounding, so the
// two paths give bit-identical outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// -- the VNNI product --------------------------------------------------------------------------
//
// Weight layout ("vnni"): int8 (NG, KG, 64, 4), NG = ceil(N / 64) groups of 64 output
// channels, KG = ceil(K / 4) groups of 4 inputs; channel group c, input group g holds
// w[64c + j, 4g + i] at [c, g, j, i] (zero where n >= N or k >= K). A group's weights are
// one contiguous stream of 256-byte lines, each four 64-byte vectors that vpdpbusd
// multiplies by four unsigned activation bytes broadcast to every lane.
// Activations: uint8 codes + 128 (fbgemm's zero point for the range [-127.5, 127.5]),
// so  sum_k (c_k + 128) w_k - 128 * sum_k w_k = sum_k c_k w_k  exactly; offsets[n] holds
// 128 * sum_k w[n, k]. Output: float(that integer) * scale[n], fbgemm's rounding.

// Bytes of a group's stream requested ahead (a prefetch never faults), into L2: requests
// to L2 may be outstanding in larger numbers than line fills of L1, and measured about 5%
// faster than T0 for 1-3 tokens on a 2-core Xeon. On AMD CPUs the tiles ask for no
// prefetch (soft_prefetch): the hardware prefetchers follow the sequential stream, and on
// a 2-core AMD EPYC the prefetch slowed the streams down (see w4_tile).
constexpr int64_t kPrefetchAhead = 8192;

bool soft_prefetch() {
  static const bool wanted = !__builtin_cpu_is("amd");
  return wanted;
}
constexpr int kVnniRows = 6;  // rows per pass over a channel group (24 accumulators of 32 registers)

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

// R rows times one channel group (64 channels): y[r, n0 + j] for j < 64, n0 + j < n.
// The 4R accumulators are named variables, not an array: GCC keeps an array of this many
// vectors in memory (or shuffles it between registers on every step), which made a
// 6-row tile run at half the speed of a 4-row one on an AMD EPYC; named, they stay in
// registers (4R + 4 weight vectors + 1 broadcast <= 29 of 32 for R <= 6).
template <int R, bool Prefetch>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_tile(
    const uint8_t* a, int64_t lda, const int8_t* w, int64_t kg, const int32_t* offsets, const float* scales,
    float* y, int64_t ldy, int64_t n0, int64_t n) {
  static_assert(R >= 1 && R <= 6, "vnni_tile holds at most 6 rows");
#define SPECVIZ_ACC(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0;
  SPECVIZ_ACC(0) SPECVIZ_ACC(1) SPECVIZ_ACC(2) SPECVIZ_ACC(3) SPECVIZ_ACC(4) SPECVIZ_ACC(5)
#undef SPECVIZ_ACC
  for (int64_t g = 0; g < kg; ++g) {
    const int8_t* line = w + g * 256;
    if constexpr (Prefetch)
      for (int b = 0; b < 4; ++b) _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchAhead + 64 * b), _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(line), w1 = _mm512_loadu_si512(line + 64),
                  w2 = _mm512_loadu_si512(line + 128), w3 = _mm512_loadu_si512(line + 192);
#define SPECVIZ_ROW(r)                                \
    if constexpr (R > r) {                            \
      int32_t quad;                                   \
      std::memcpy(&quad, a + r * lda + 4 * g, 4);     \
      const __m512i av = _mm512_set1_epi32(quad);     \
      c##r##0 = _mm512_dpbusd_epi32(c##r##0, av, w0); \
      c##r##1 = _mm512_dpbusd_epi32(c##r##1, av, w1); \
      c##r##2 = _mm512_dpbusd_epi32(c##r##2, av, w2); \
      c##r##3 = _mm512_dpbusd_epi32(c##r##3, av, w3); \
    }
    SPECVIZ_ROW(0) SPECVIZ_ROW(1) SPECVIZ_ROW(2) SPECVIZ_ROW(3) SPECVIZ_ROW(4) SPECVIZ_ROW(5)
#undef SPECVIZ_ROW
  }
  const __m512i acc[6][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                             {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
  for (int b = 0; b < 4; ++b) {
    const int64_t c0 = n0 + 16 * b;
    if (c0 >= n) break;
    const __mmask16 live = c0 + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c0)) - 1u);
    const __m512i off = _mm512_maskz_loadu_epi32(live, offsets + c0);
    const __m512 sc = _mm512_maskz_loadu_ps(live, scales + c0);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], off));
      _mm512_mask_storeu_ps(y + r * ldy + c0, live, _mm512_mul_ps(v, sc));
    }
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*, float*,
                        int64_t, int64_t, int64_t);
constexpr TileFn kTiles[2][kVnniRows] = {
    {vnni_tile<1, false>, vnni_tile<2, false>, vnni_tile<3, false>, vnni_tile<4, false>, vnni_tile<5, false>,
     vnni_tile<6, false>},
    {vnni_tile<1, true>, vnni_tile<2, true>, vnni_tile<3, true>, vnni_tile<4, true>, vnni_tile<5, true>,
     vnni_tile<6, true>}};

// y (rows, N) = the exact integer products of codes (rows, K4) uint8 with the weight,
// times scales: fbgemm's apply_dynamic for the same codes, without its range columns.
at::Tensor vnni_product(const at::Tensor& codes, const at::Tensor& weight, const at::Tensor& offsets,
                        const at::Tensor& scales) {
  const int64_t rows = codes.size(0), k4 = codes.size(1);
  const int64_t ng = weight.size(0), kg = weight.size(1), n = scales.size(0);
  TORCH_CHECK(kg * 4 == k4 && ng * 64 >= n && offsets.size(0) == n, "vnni weight does not match the codes");
  at::Tensor y = at::empty({rows, n}, scales.options());
  const uint8_t* a = codes.data_ptr<uint8_t>();
  const int8_t* w = weight.data_ptr<int8_t>();
  const int32_t* off = offsets.data_ptr<int32_t>();
  const float* sc = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each channel group's weights stream from memory once; its later row chunks find them
  // in the cache (a group of the 1.5B target holds at most 64 x 8960 bytes).
  const TileFn* tiles = kTiles[soft_prefetch()];
  at::parallel_for(0, ng, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t r0 = 0; r0 < rows; r0 += kVnniRows) {
        const int64_t r = std::min<int64_t>(kVnniRows, rows - r0);
        tiles[r - 1](a + r0 * k4, k4, w + c * kg * 256, kg, off, sc, yp + r0 * n, n, 64 * c, n);
      }
    }
  });
  return y;
}

// out[r] = products[r] * step[r] (+ products[m + r] * step2[r] with the residual pass)
// (+ bias): each product and sum rounded on its own, as the PyTorch code's separate
// operators (no fused multiply-add, whose use would depend on how a library was compiled).
void rescale_rows(const float* yp, int64_t m, int64_t n, bool residual, const std::vector<float>& step,
                  const std::vector<float>& step2, const float* bp, float* op) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* y0 = yp + r * n;
      const float* y1 = residual ? yp + (m + r) * n : nullptr;
      float* o = op + r * n;
      const float s = step[r];
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
}

// The layer's output from the products y (P*M, N) of its M rows: rescaled per row
// (rescale_rows), with the bias, in the input's shape with N outputs.
at::Tensor rescaled(const at::Tensor& y, const at::Tensor& x, int64_t m, bool residual,
                    const std::vector<float>& step, const std::vector<float>& step2,
                    const std::optional<at::Tensor>& bias) {
  const int64_t n = y.size(1);
  at::Tensor out = residual ? at::empty({m, n}, y.options()) : y;  // (M, N)
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "bias has ", b.numel(), " entries for ", n, " outputs");
    bp = b.data_ptr<float>();
  }
  rescale_rows(y.data_ptr<float>(), m, n, residual, step, step2, bp, out.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

bool vnni_available() { return cpu_has_vnni(); }

at::Tensor w8a8_token_linear(const at::Tensor& x, const at::Tensor& inv_smooth,
                             const c10::intrusive_ptr<LinearPackedParamsBase>& packed,
                             const std::optional<at::Tensor>& bias, bool residual,
                             const std::optional<at::Tensor>& vnni_weight, const std::optional<at::Tensor>& vnni_offsets,
                             const std::optional<at::Tensor>& vnni_scales, int64_t vnni_max_rows) {
  TORCH_CHECK(x.device().is_cpu() && inv_smooth.device().is_cpu(), "w8a8_token_linear runs on the CPU");
  TORCH_CHECK(inv_smooth.dim() == 1 && inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous(),
              "inv_smooth must be a contiguous float32 vector");
  const int64_t k = inv_smooth.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input's last dimension is ", x.size(-1), ", the layer takes ", k);
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();  // (M, K)
  const int64_t m = x2.size(0);
  const int64_t passes = residual ? 2 : 1;
  const int64_t width = k + 2;
  // The VNNI kernel takes the codes as bytes (code + 128, zero-padded to whole groups of
  // four inputs); fbgemm takes them as floats with the two range columns. The quantization
  // pass writes whichever the product reads.
  const bool use_vnni = vnni_weight.has_value() && vnni_weight->defined() && passes * m <= vnni_max_rows &&
                        cpu_has_vnni();
  int64_t k4 = 0;
  if (use_vnni) {
    TORCH_CHECK(vnni_offsets.has_value() && vnni_scales.has_value(), "vnni weight without offsets or scales");
    const at::Tensor& vw = *vnni_weight;
    TORCH_CHECK(vw.dim() == 4 && vw.scalar_type() == at::kChar && vw.is_contiguous() && vw.size(2) == 64 &&
                    vw.size(3) == 4 && vw.size(1) * 4 >= k,
                "vnni weight must be a contiguous int8 (NG, KG, 64, 4) tensor covering ", k, " inputs");
    TORCH_CHECK(vnni_offsets->scalar_type() == at::kInt && vnni_offsets->is_contiguous() &&
                    vnni_scales->scalar_type() == at::kFloat && vnni_scales->is_contiguous(),
                "vnni offsets must be contiguous int32, scales contiguous float32");
    k4 = vw.size(1) * 4;
  }
  at::Tensor fed = use_vnni ? at::empty({passes * m, k4}, x2.options().dtype(at::kByte))  // (P*M, K4) codes + 128
                            : at::empty({passes * m, width}, x2.options());              // (P*M, K + 2)
  std::vector<float> step(m), step2(m);
  const float* xs = x2.data_ptr<float>();
  const float* smooth = inv_smooth.data_ptr<float>();
  float* f = use_vnni ? nullptr : fed.data_ptr<float>();
  uint8_t* bytes = use_vnni ? fed.data_ptr<uint8_t>() : nullptr;
  // fbgemm's rows are written in place; the VNNI kernel's go through a float scratch row
  auto code_row = [&](int64_t row, std::vector<float>& scratch) {
    return use_vnni ? scratch.data() : f + row * width;
  };
  // finish a row of codes (integers held in floats, |c| <= 127) for the product
  auto finish = [&](int64_t row, const float* c) {
    if (use_vnni) {
      uint8_t* dst = bytes + row * k4;
      for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<uint8_t>(static_cast<int32_t>(c[i]) + 128);
      for (int64_t i = k; i < k4; ++i) dst[i] = 128;  // code 0 against zero weights
    } else {
      float* dst = f + row * width;
      dst[k] = kRange;
      dst[k + 1] = -kRange;
    }
  };
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(k), scratch(use_vnni ? k : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * k;
      float* codes = code_row(r, scratch);
      for (int64_t i = 0; i < k; ++i) t[i] = xr[i] * smooth[i];  // smoothed
      const float amax = std::max(absmax(t.data(), k), 1e-30f);
      const float scale = (1.0f / amax) * kCodes;  // as torch computes 127 / tensor
      for (int64_t i = 0; i < k; ++i) {
        const float v = t[i] * scale;
        const float c = std::nearbyint(v);  // round half to even, as torch.round
        codes[i] = c;
        t[i] = v - c;  // rounding error in codes, |e| <= 1/2
      }
      finish(r, codes);
      step[r] = amax / kCodes;
      if (residual) {
        float* rest = code_row(m + r, scratch);
        const float emax = std::max(absmax(t.data(), k), 1e-30f);
        const float scale2 = (1.0f / emax) * kCodes;
        for (int64_t i = 0; i < k; ++i) rest[i] = std::nearbyint(t[i] * scale2);
        finish(m + r, rest);
        step2[r] = step[r] * (emax / kCodes);
      }
    }
  });
  at::Tensor y;
  if (use_vnni) {
    y = vnni_product(fed, *vnni_weight, *vnni_offsets, *vnni_scales);  // (P*M, N), the same values as fbgemm's
  } else {
    y = packed->apply_dynamic(fed, /*reduce_range=*/false);  // (P*M, N) exact products x w_scale
  }
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == passes * m, "unexpected product shape");
  y = y.contiguous();
  return rescaled(y, x, m, residual, step, step2, bias);
}


// -- specviz::w4a8_token_linear --------------------------------------------------------------
//
// 4-bit weights with a scale and a minimum per group of 64 inputs (w = s * q + z, q in
// 0..15), times the same per-token int8 activation codes (and residual codes) as above.
// Each row's output is  sum over groups g, in order:  acc = (acc + float(dot_g) * s_g) +
// z_g * float(xsum_g),  where dot_g = sum of q * code over the group's 64 inputs (an exact
// integer) and xsum_g the group's sum of codes; then rescaled per token as above. Every row
// runs the same instructions whatever the row count, so a token's output does not depend
// on its forward's other rows (prefills included: no other kernel is used).
//
// Weight stream ("w4"): uint8 (NG, G, 2304), NG = ceil(N / 64) blocks of 64 output
// channels, G = Kp / 64 groups of 64 inputs (Kp = K rounded up). Block c, group g: 8 lines of
// 256 bytes, line o holding for channel 64c + j (j = 16b + lane) and i < 4 the byte at
// [o, b, lane, i] = q[.., 64g + 8o + i] | q[.., 64g + 8o + 4 + i] << 4; then 64 fp16 scales
// and 64 fp16 minimums of the group's channels. A block is one contiguous stream.
//
// The tile prefetches as the VNNI product does, except on AMD CPUs (soft_prefetch), where
// the hardware prefetchers follow the sequential stream better alone: with the prefetch
// (8 KB ahead, into L2) the 4-bit layers of the built-in 0.5B draft (265 MB, one token, 2
// threads of an AMD EPYC, medians of 25 passes) took 8.9-11.0 ms; without it 7.3-7.6 ms
// (27 GB/s); prefetching 0.5-4 KB ahead into L1 or L2 gave 5.8-7.8 ms, no clear gain (one
// thread: 14.4-14.6 against 8.8-9.1 ms without).

constexpr int kW4Rows = 4;                 // rows per pass over a block (16 accumulators)
constexpr int64_t kW4GroupBytes = 2304;    // 8 lines of 256 weight bytes + 256 bytes of scales
constexpr int64_t kW4Group = 64;           // inputs per group

template <int R, bool Prefetch>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void w4_tile(
    const int8_t* a, int64_t lda, const float* xsum, int64_t ldx, const uint8_t* w, int64_t groups,
    float* y, int64_t ldy, int64_t n0, int64_t n) {
  alignas(64) float f[R][64];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 64; ++j) f[r][j] = 0.0f;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kW4GroupBytes;
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_si512();
    for (int o = 0; o < 8; ++o) {
      const uint8_t* line = blk + o * 256;
      if constexpr (Prefetch)
        for (int b = 0; b < 4; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchAhead + 64 * b), _MM_HINT_T1);
      __m512i lo[4], hi[4];
      for (int b = 0; b < 4; ++b) {
        const __m512i raw = _mm512_loadu_si512(line + b * 64);
        lo[b] = _mm512_and_si512(raw, low);
        hi[b] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        int32_t q0, q1;
        std::memcpy(&q0, a + r * lda + g * kW4Group + 8 * o, 4);
        std::memcpy(&q1, a + r * lda + g * kW4Group + 8 * o + 4, 4);
        const __m512i a0 = _mm512_set1_epi32(q0), a1 = _mm512_set1_epi32(q1);
        for (int b = 0; b < 4; ++b) {
          acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], lo[b], a0);
          acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], hi[b], a1);
        }
      }
    }
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(blk + 2048);
    for (int b = 0; b < 4; ++b) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 16 * b)));
      const __m512 zc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 64 + 16 * b)));
      for (int r = 0; r < R; ++r) {
        __m512 fv = _mm512_load_ps(f[r] + 16 * b);
        fv = _mm512_add_ps(fv, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][b]), sc));
        fv = _mm512_add_ps(fv, _mm512_mul_ps(zc, _mm512_set1_ps(xsum[r * ldx + g])));
        _mm512_store_ps(f[r] + 16 * b, fv);
      }
    }
  }
  for (int b = 0; b < 4; ++b) {
    const int64_t c0 = n0 + 16 * b;
    if (c0 >= n) break;
    const __mmask16 live = c0 + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c0)) - 1u);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + c0, live, _mm512_load_ps(f[r] + 16 * b));
  }
}

// The same arithmetic with AVX2 (CPUs without AVX-512 VNNI): R <= 2 rows times half a block
// (32 channels, four 8-channel chunks of each 256-byte line). vpmaddubsw multiplies the
// unsigned codes by the signed activation bytes in pairs (|sum| <= 2 * 15 * 127, so no
// saturation; the low and high nibbles' pairs of four lines add up to at most 30480 in 16
// bits), vpmaddwd sums those pairs into each channel's int32: the same exact integers as
// vpdpbusd, scaled and corrected in the same order, so the outputs are the same bits.
template <int R>
__attribute__((target("avx2,f16c"))) void w4_tile_avx2(
    const int8_t* a, int64_t lda, const float* xsum, int64_t ldx, const uint8_t* w, int64_t groups,
    float* y, int64_t ldy, int64_t n0, int64_t n, int half) {
  alignas(32) float f[R][32];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 32; ++j) f[r][j] = 0.0f;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kW4GroupBytes;
    __m256i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_si256();
    // Four lines' pair sums add up in 16 bits (at most 4 * 7620) before widening.
    for (int o0 = 0; o0 < 8; o0 += 4) {
      __m256i pairs[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) pairs[r][c] = _mm256_setzero_si256();
      for (int o = o0; o < o0 + 4; ++o) {
        const uint8_t* line = blk + o * 256 + 128 * half;
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * c));
          lo[c] = _mm256_and_si256(raw, low);
          hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          int32_t q0, q1;
          std::memcpy(&q0, a + r * lda + g * kW4Group + 8 * o, 4);
          std::memcpy(&q1, a + r * lda + g * kW4Group + 8 * o + 4, 4);
          const __m256i a0 = _mm256_set1_epi32(q0), a1 = _mm256_set1_epi32(q1);
          for (int c = 0; c < 4; ++c)
            pairs[r][c] = _mm256_add_epi16(pairs[r][c], _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], a0),
                                                                         _mm256_maddubs_epi16(hi[c], a1)));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs[r][c], ones));
    }
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(blk + 2048) + 32 * half;
    for (int c = 0; c < 4; ++c) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 8 * c)));
      const __m256 zc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 64 + 8 * c)));
      for (int r = 0; r < R; ++r) {
        __m256 fv = _mm256_load_ps(f[r] + 8 * c);
        fv = _mm256_add_ps(fv, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][c]), sc));
        fv = _mm256_add_ps(fv, _mm256_mul_ps(zc, _mm256_set1_ps(xsum[r * ldx + g])));
        _mm256_store_ps(f[r] + 8 * c, fv);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 32 && n0 + 32 * half + j < n; ++j) y[r * ldy + n0 + 32 * half + j] = f[r][j];
}

constexpr int kW4Avx2Rows = 2;
using W4Avx2TileFn = void (*)(const int8_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t,
                              int64_t, int64_t, int);
constexpr W4Avx2TileFn kW4Avx2Tiles[kW4Avx2Rows] = {w4_tile_avx2<1>, w4_tile_avx2<2>};

using W4TileFn = void (*)(const int8_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t,
                          int64_t, int64_t);
constexpr W4TileFn kW4Tiles[2][kW4Rows] = {
    {w4_tile<1, false>, w4_tile<2, false>, w4_tile<3, false>, w4_tile<4, false>},
    {w4_tile<1, true>, w4_tile<2, true>, w4_tile<3, true>, w4_tile<4, true>}};

at::Tensor w4a8_token_linear(const at::Tensor& x, const at::Tensor& inv_smooth, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, bool residual, int64_t out_features,
                             bool use_vnni) {
  TORCH_CHECK(x.device().is_cpu() && inv_smooth.device().is_cpu() && weight.device().is_cpu(),
              "w4a8_token_linear runs on the CPU");
  TORCH_CHECK(inv_smooth.dim() == 1 && inv_smooth.scalar_type() == at::kFloat && inv_smooth.is_contiguous(),
              "inv_smooth must be a contiguous float32 vector");
  const int64_t k = inv_smooth.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "input's last dimension is ", x.size(-1), ", the layer takes ", k);
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(2) == kW4GroupBytes && weight.size(1) * kW4Group >= k &&
                  weight.size(0) * 64 >= out_features && out_features > 0,
              "w4 weight must be a contiguous uint8 (NG, G, 2304) stream covering ", k, " inputs and ",
              out_features, " outputs");
  const int64_t n = out_features, ng = weight.size(0), groups = weight.size(1), kp = groups * kW4Group;
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();  // (M, K)
  const int64_t m = x2.size(0);
  const int64_t passes = residual ? 2 : 1, rows = passes * m;
  at::Tensor codes = at::zeros({rows, kp}, x2.options().dtype(at::kChar));  // (P*M, Kp) signed codes
  at::Tensor sums = at::empty({rows, groups}, x2.options());                // (P*M, G) codes per group, summed
  std::vector<float> step(m), step2(m);
  const float* xs = x2.data_ptr<float>();
  const float* smooth = inv_smooth.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* sp = sums.data_ptr<float>();
  auto finish = [&](int64_t row, const float* c) {
    int8_t* dst = cp + row * kp;
    for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<int8_t>(static_cast<int32_t>(c[i]));
    for (int64_t g = 0; g < groups; ++g) {
      int32_t total = 0;
      for (int64_t i = g * kW4Group; i < std::min(k, (g + 1) * kW4Group); ++i) total += dst[i];
      sp[row * groups + g] = static_cast<float>(total);
    }
  };
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(k), c(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * k;
      for (int64_t i = 0; i < k; ++i) t[i] = xr[i] * smooth[i];
      const float amax = std::max(absmax(t.data(), k), 1e-30f);
      const float scale = (1.0f / amax) * kCodes;
      for (int64_t i = 0; i < k; ++i) {
        const float v = t[i] * scale;
        const float q = std::nearbyint(v);
        c[i] = q;
        t[i] = v - q;
      }
      finish(r, c.data());
      step[r] = amax / kCodes;
      if (residual) {
        const float emax = std::max(absmax(t.data(), k), 1e-30f);
        const float scale2 = (1.0f / emax) * kCodes;
        for (int64_t i = 0; i < k; ++i) c[i] = std::nearbyint(t[i] * scale2);
        finish(m + r, c.data());
        step2[r] = step[r] * (emax / kCodes);
      }
    }
  });
  at::Tensor y = at::empty({rows, n}, x2.options());  // (P*M, N)
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"),
              "w4a8_token_linear needs a CPU with AVX2 and F16C");
  const bool vnni = use_vnni && cpu_has_vnni();
  const W4TileFn* w4_tiles = kW4Tiles[soft_prefetch()];
  // Each block's stream is read from memory once; its later row chunks find it in the cache.
  at::parallel_for(0, ng, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const uint8_t* wc = wp + c * groups * kW4GroupBytes;
      const int64_t tile = vnni ? kW4Rows : kW4Avx2Rows;
      for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t r = std::min<int64_t>(tile, rows - r0);
        if (vnni) {
          w4_tiles[r - 1](cp + r0 * kp, kp, sp + r0 * groups, groups, wc, groups, yp + r0 * n, n, 64 * c, n);
        } else {
          for (int half = 0; half < 2 && 64 * c + 32 * half < n; ++half)
            kW4Avx2Tiles[r - 1](cp + r0 * kp, kp, sp + r0 * groups, groups, wc, groups, yp + r0 * n, n, 64 * c, n,
                                half);
        }
      }
    }
  });
  return rescaled(y, x, m, residual, step, step2, bias);
}


// -- specviz::w4a8_decoder_layer -----------------------------------------------------------
//
// A whole Llama-style decoder layer (RMSNorm, query/key/value, rotary embedding, attention
// over the cache, output projection, RMSNorm, SwiGLU MLP, both residual additions) in one
// call, its four products from w4a8_token_linear above. It is for a draft model, whose
// outputs only have to be good proposals: the norms, rotary embedding and attention are
// this code's own float arithmetic, not PyTorch's operators, so its outputs differ from
// the modules' forward by rounding. What it saves is most of the per-layer cost around the
// products (about 60 small operators and their dispatch per layer): a one-token forward of
// the 4-bit 0.5B draft on a 2-core CPU took 20.7 ms against 28.6 ms through the modules.
//
// Rows: B sequences of N new tokens each, every one of which attends to all `held` cached
// slots of its sequence and causally to the new ones (a plain decoding or catch-up
// forward), or, given `allowed` (B, N, held + N) bool, to the slots it marks (a draft tree:
// each node sees the context, its ancestors and itself; every row must mark one slot at
// least). The new keys and values are written into the cache buffers at slots
// [held, held + N), which must have room for them.

// sum of a[i] * b[i] (eight partial sums, added pairwise at the end)
float dot(const float* a, const float* b, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

// out = weight * (x / sqrt(mean(x^2) + eps)), row by row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t m = x.size(0), e = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = xp + r * e;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, e) / static_cast<float>(e) + static_cast<float>(eps));
    for (int64_t i = 0; i < e; ++i) op[r * e + i] = wp[i] * (xp[r * e + i] * inv);
  }
  return out;
}

at::Tensor w4a8_decoder_layer(const at::Tensor& h, const at::Tensor& keys, const at::Tensor& values, int64_t held,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& input_norm,
                              const at::Tensor& post_norm, double eps, const at::Tensor& qkv_smooth,
                              const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
                              const at::Tensor& o_smooth, const at::Tensor& o_weight,
                              const std::optional<at::Tensor>& o_bias, const at::Tensor& gate_up_smooth,
                              const at::Tensor& gate_up_weight, const std::optional<at::Tensor>& gate_up_bias,
                              const at::Tensor& down_smooth, const at::Tensor& down_weight,
                              const std::optional<at::Tensor>& down_bias, int64_t q_heads, int64_t kv_heads,
                              int64_t head_dim, int64_t intermediate, double scaling, bool residual, bool use_vnni,
                              const std::optional<at::Tensor>& allowed) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat && h.device().is_cpu(),
              "w4a8_decoder_layer: h must be a float32 (B, N, E) CPU tensor");
  const int64_t b = h.size(0), n = h.size(1), e = h.size(2), d = head_dim, m = b * n;
  TORCH_CHECK(q_heads > 0 && kv_heads > 0 && q_heads % kv_heads == 0 && d % 2 == 0,
              "w4a8_decoder_layer: ", q_heads, " query heads cannot share ", kv_heads, " key/value heads of size ", d);
  for (const at::Tensor* c : {&keys, &values}) {
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == at::kFloat && c->size(0) == b && c->size(1) == kv_heads &&
                    c->size(3) == d && c->stride(3) == 1 && c->size(2) >= held + n && held >= 0,
                "w4a8_decoder_layer: cache buffers must be float32 (", b, ", ", kv_heads, ", >= ", held + n, ", ", d,
                ") with unit stride in the last dimension");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == b && cos.size(1) == n &&
                  cos.size(2) == d && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "w4a8_decoder_layer: cos and sin must be float32 (", b, ", ", n, ", ", d, ")");
  for (const at::Tensor* w : {&input_norm, &post_norm}) {
    TORCH_CHECK(w->dim() == 1 && w->size(0) == e && w->scalar_type() == at::kFloat && w->is_contiguous(),
                "w4a8_decoder_layer: norm weights must be contiguous float32 (", e, ",)");
  }
  at::Tensor mask;  // (B, N, held + N) bool, or undefined: causal
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->dim() == 3 && allowed->scalar_type() == at::kBool && allowed->size(0) == b &&
                    allowed->size(1) == n && allowed->size(2) == held + n && allowed->device().is_cpu(),
                "w4a8_decoder_layer: allowed must be a bool (", b, ", ", n, ", ", held + n, ") CPU tensor");
    mask = allowed->contiguous();
    TORCH_CHECK(n == 0 || mask.any(2).all().item<bool>(), "w4a8_decoder_layer: a row of allowed marks no slot");
  }
  const bool* maskp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t qd = q_heads * d, kd = kv_heads * d, group = q_heads / kv_heads;
  at::Tensor x = h.reshape({m, e}).contiguous();  // (M, E)
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  // Each product shows in a profile as the layer operator's own (specviz.bench profile
  // counts it as an integer product), the rest as this operator's time.
  auto product = [&](const at::Tensor& in, const at::Tensor& smooth, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, int64_t outputs) {
    RECORD_FUNCTION("specviz::w4a8_token_linear", std::vector<c10::IValue>());
    return w4a8_token_linear(in, smooth, weight, bias, residual, outputs, use_vnni);
  };
  at::Tensor qkv = product(rms_norm(x, input_norm, eps), qkv_smooth, qkv_weight, qkv_bias, qd + 2 * kd);
  // Rotary embedding (x * cos + rotate_half(x) * sin) of queries and keys; keys and values
  // into their cache slots.
  at::Tensor q = at::empty({m, qd}, x.options());  // (M, heads * D)
  const float* qkvp = qkv.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t half = d / 2;
  auto rotate = [&](const float* src, const float* cr, const float* sr, float* dst) {
    for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * cr[i] + (-src[i + half]) * sr[i];
    for (int64_t i = half; i < d; ++i) dst[i] = src[i] * cr[i] + src[i - half] * sr[i];
  };
  for (int64_t r = 0; r < m; ++r) {
    const int64_t row_b = r / n, slot = held + r % n;
    const float* row = qkvp + r * (qd + 2 * kd);
    const float* cr = cp + r * d;
    const float* sr = sp + r * d;
    for (int64_t hq = 0; hq < q_heads; ++hq) rotate(row + hq * d, cr, sr, qp + r * qd + hq * d);
    for (int64_t hk = 0; hk < kv_heads; ++hk) {
      rotate(row + qd + hk * d, cr, sr, kp + row_b * ks0 + hk * ks1 + slot * ks2);
      std::memcpy(vp + row_b * vs0 + hk * vs1 + slot * vs2, row + qd + kd + hk * d, d * sizeof(float));
    }
  }
  // Attention: query i of a sequence sees slots [0, held + i] (or those `allowed` marks); a
  // softmax in float32.
  at::Tensor att = at::empty({m, qd}, x.options());  // (M, heads * D), transformers' (B, N, heads, D)
  float* ap = att.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  {
    RECORD_FUNCTION("specviz::w4a8_decoder_layer_attention", std::vector<c10::IValue>());
    at::parallel_for(0, b * q_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> score(held + n);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t row_b = job / q_heads, hq = job % q_heads, hk = hq / group;
        const float* kb = kp + row_b * ks0 + hk * ks1;
        const float* vb = vp + row_b * vs0 + hk * vs1;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = row_b * n + i, len = maskp == nullptr ? held + i + 1 : held + n;
          const bool* seen = maskp == nullptr ? nullptr : maskp + r * (held + n);  // (held + N,)
          const float* qr = qp + r * qd + hq * d;
          float top = -INFINITY;
          for (int64_t t = 0; t < len; ++t) {
            score[t] = seen != nullptr && !seen[t] ? -INFINITY : dot(qr, kb + t * ks2, d) * scale;
            top = std::max(top, score[t]);
          }
          float total = 0.0f;
          for (int64_t t = 0; t < len; ++t) {
            score[t] = std::exp(score[t] - top);
            total += score[t];
          }
          float* out = ap + r * qd + hq * d;
          for (int64_t j = 0; j < d; ++j) out[j] = 0.0f;
          for (int64_t t = 0; t < len; ++t) {
            const float p = score[t];
            if (p == 0.0f) continue;  // a slot the row does not see
            const float* vr = vb + t * vs2;
            for (int64_t j = 0; j < d; ++j) out[j] += p * vr[j];
          }
          const float inv = 1.0f / total;
          for (int64_t j = 0; j < d; ++j) out[j] *= inv;
        }
      }
    });
  }
  at::Tensor mid = x + product(att, o_smooth, o_weight, o_bias, e);  // (M, E)
  at::Tensor gu = product(rms_norm(mid, post_norm, eps), gate_up_smooth, gate_up_weight, gate_up_bias,
                          2 * intermediate);  // (M, 2I): gate, then up
  at::Tensor act = at::empty({m, intermediate}, x.options());
  const float* gp = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* g = gp + r * 2 * intermediate;
    const float* u = g + intermediate;
    for (int64_t j = 0; j < intermediate; ++j) actp[r * intermediate + j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
  at::Tensor out = mid + product(act, down_smooth, down_weight, down_bias, e);
  return out.view({b, n, e});
}

}  // namespace

TORCH_LIBRARY(specviz, m) {
  m.def("w8a8_token_linear(Tensor x, Tensor inv_smooth, "
        "__torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor? bias, bool residual, "
        "Tensor? vnni_weight=None, Tensor? vnni_offsets=None, Tensor? vnni_scales=None, int vnni_max_rows=0) -> Tensor");
  m.def("vnni_available() -> bool", TORCH_FN(vnni_available));
  m.def("w4a8_token_linear(Tensor x, Tensor inv_smooth, Tensor weight, Tensor? bias, bool residual, "
        "int out_features, bool use_vnni=True) -> Tensor");
  m.def("w4a8_decoder_layer(Tensor h, Tensor(a!) keys, Tensor(b!) values, int held, Tensor cos, Tensor sin, "
        "Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_smooth, Tensor qkv_weight, Tensor? qkv_bias, "
        "Tensor o_smooth, Tensor o_weight, Tensor? o_bias, Tensor gate_up_smooth, Tensor gate_up_weight, "
        "Tensor? gate_up_bias, Tensor down_smooth, Tensor down_weight, Tensor? down_bias, int q_heads, "
        "int kv_heads, int head_dim, int intermediate, float scaling, bool residual, bool use_vnni=True, "
        "Tensor? allowed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specviz, CPU, m) {
  m.impl("w8a8_token_linear", TORCH_FN(w8a8_token_linear));
  m.impl("w4a8_token_linear", TORCH_FN(w4a8_token_linear));
  m.impl("w4a8_decoder_layer", TORCH_FN(w4a8_decoder_layer));
}
