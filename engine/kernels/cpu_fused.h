// What our quantized linear folds around its product (cpu_quant_linear.cpp), so that a decode
// step's layer is its linears and its attention, with no kernel between them:
//   before, on each input row: an RMSNorm (Llama's: x * rsqrt(mean(x^2) + eps), rounded to the
//     dtype, times the weight, rounded), or a gated activation (SwiGLU: the row is [gate | up],
//     silu(gate) rounded to the dtype, times up, rounded);
//   after, on each output row: a residual added (the product rounded to the dtype first, then
//     the sum rounded), as `h + linear(x)` rounds in torch.
// The roundings are torch's eager ones, so a fused linear gives what the unfused modules give up
// to the norm's summation order and exp's last bit. Every path gives the same bits: the scalar
// code is the definition, the AVX2 code performs the same IEEE operations in the same order
// (fma where the scalar code calls fmaf).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include "cpu_bf16.h"

namespace workbench_fused {

using workbench_bf16::bf16_to_float;
using workbench_bf16::float_to_bf16;

inline float round_to(float v, bool bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

// out[k] = w[k] * (x[k] * r), r = 1 / sqrt(sum(x^2) / K + eps), the sum over 16 lanes (k mod 16)
// then across them in order; K a multiple of 16
inline float rms_scale(const float* lanes, int64_t K, float eps) {
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
}

inline void rms_norm_row_scalar(const float* x, const float* w, int64_t K, float eps, bool bf16, float* out) {
  float lanes[16] = {};
  for (int64_t k = 0; k < K; k += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[k + j] * x[k + j];
  const float r = rms_scale(lanes, K, eps);
  for (int64_t k = 0; k < K; ++k) out[k] = round_to(w[k] * round_to(x[k] * r, bf16), bf16);
}

// bf16 rounding of 8 floats, as float_to_bf16 (nearest even, NaN kept), back to float
__attribute__((target("avx2"))) inline __m256 round8_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i kept = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  const __m256i top = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_blendv_epi8(rounded, kept, nan), top));
}

__attribute__((target("avx2")))
inline void rms_norm_row_avx2(const float* x, const float* w, int64_t K, float eps, bool bf16, float* out) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 a = _mm256_loadu_ps(x + k), b = _mm256_loadu_ps(x + k + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
  const __m256 r = _mm256_set1_ps(rms_scale(lanes, K, eps));
  for (int64_t k = 0; k < K; k += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), r);
    if (bf16) v = round8_bf16(v);
    v = _mm256_mul_ps(_mm256_loadu_ps(w + k), v);
    if (bf16) v = round8_bf16(v);
    _mm256_storeu_ps(out + k, v);
  }
}

// e^x as Cephes' expf (within about 1 ulp): exp(x) = 2^n * p(x - n ln 2)
// inputs clamped to [-87, 88], where 2^n stays a normal float (exp(88) = 1.7e38)
constexpr float EXP_LO = -87.0f, EXP_HI = 88.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_scalar(float x) {
  x = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
  const float n = std::floor(std::fmaf(x, LOG2E, 0.5f));
  x = std::fmaf(-n, LN2_HI, x);
  x = std::fmaf(-n, LN2_LO, x);
  float y = EXP_P[0];
  for (int i = 1; i < 6; ++i) y = std::fmaf(y, x, EXP_P[i]);
  y = std::fmaf(y, x * x, x) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

__attribute__((target("avx2,fma"))) inline __m256 exp8_avx2(__m256 x) {
  // max/min in the scalar code's order: a NaN input gives a clamped value (its silu is NaN anyway)
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_HI)), _mm256_set1_ps(EXP_LO));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), x);
  __m256 y = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// silu(g) = g / (1 + e^-g), as torch's CPU silu writes it
inline void silu_mul_row_scalar(const float* gate, const float* up, int64_t K, bool bf16, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const float s = round_to(gate[k] / (1.0f + exp_scalar(-gate[k])), bf16);
    out[k] = round_to(s * up[k], bf16);
  }
}

__attribute__((target("avx2,fma")))
inline void silu_mul_row_avx2(const float* gate, const float* up, int64_t K, bool bf16, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 g = _mm256_loadu_ps(gate + k);
    __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8_avx2(_mm256_xor_ps(g, sign))));
    if (bf16) s = round8_bf16(s);
    __m256 v = _mm256_mul_ps(s, _mm256_loadu_ps(up + k));
    if (bf16) v = round8_bf16(v);
    _mm256_storeu_ps(out + k, v);
  }
  if (k < K) silu_mul_row_scalar(gate + k, up + k, K - k, bf16, out + k);
}

}  // namespace workbench_fused
