// workbench_cpu::linear — y[M, N] = x[M, K] @ W^T (+ bias) on the CPU, for weights packed at load
// into column blocks: w[N / NB, K, NB] (NB = 32 output columns, K-major inside a block).
//
// Row-invariant and ISA-invariant by construction: each output element is ONE fused
// multiply-add chain over k = 0, 1, ..., K-1 in order, in fp32, starting from 0 (the bias is
// added after). Vectors run across output columns, never across k, so no horizontal sum
// exists whose order could depend on the row count or the vector width: 1 row or 64, the
// AVX-512 path (16 lanes), the AVX2 path (8 lanes) and the scalar path (std::fma) give each
// row the same bits. Threads split column blocks, never K. A weight is read once per call
// for all the rows that use it, so a decode step (1 row) and a verify pass (k + 1 rows)
// cost about the same weight traffic.
//
// bf16 weights/activations are widened to fp32 exactly (a 16-bit shift) and the result is
// rounded to bf16 once, to nearest even, as torch rounds.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include "cpu_bf16.h"
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t NB = 32;

using workbench_bf16::bf16_to_float;
using workbench_bf16::float_to_bf16;

// ---- AVX-512: 2 vectors of 16 columns per row, up to 8 rows at once ----------------------
template <typename W> __attribute__((target("avx512f"))) inline __m512 load16_512(const W* p);
template <> __attribute__((target("avx512f"))) inline __m512 load16_512<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <> __attribute__((target("avx512f"))) inline __m512 load16_512<uint16_t>(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, typename W>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t K, const W* w, float* y, int64_t ldy) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w0 = load16_512<W>(w + k * NB), w1 = load16_512<W>(w + k * NB + 16);
    for (int r = 0; r < R; ++r) {
      __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

// ---- AVX2 + FMA: 4 vectors of 8 columns per row, up to 2 rows at once ---------------------
template <typename W> __attribute__((target("avx2,fma"))) inline __m256 load8_256(const W* p);
template <> __attribute__((target("avx2,fma"))) inline __m256 load8_256<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <> __attribute__((target("avx2,fma"))) inline __m256 load8_256<uint16_t>(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, typename W>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t K, const W* w, float* y, int64_t ldy) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = load8_256<W>(w + k * NB + 8 * v);
    for (int r = 0; r < R; ++r) {
      __m256 xb = _mm256_set1_ps(x[r * K + k]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + r * ldy + 8 * v, acc[r][v]);
}

// ---- scalar: the same chains with std::fma (bit-identical to the vector FMAs) ------------
template <typename W> inline float widen(W v);
template <> inline float widen<float>(float v) { return v; }
template <> inline float widen<uint16_t>(uint16_t v) { return bf16_to_float(v); }

template <typename W>
void tile_scalar(const float* x, int64_t K, const W* w, float* y) {
  float acc[NB] = {0.0f};
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < NB; ++n) acc[n] = std::fma(x[k], widen<W>(w[k * NB + n]), acc[n]);
  std::memcpy(y, acc, sizeof(acc));
}

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

// One column block for all M rows (x fp32 [M, K]) into y fp32 [M, ldy] at column offset.
template <typename W>
void block(Isa isa, const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  int64_t m = 0;
  if (isa == AVX512) {
    for (; m + 8 <= M; m += 8) tile_avx512<8, W>(x + m * K, K, w, y + m * ldy, ldy);
    switch (M - m) {
      case 7: tile_avx512<7, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 6: tile_avx512<6, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 5: tile_avx512<5, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 4: tile_avx512<4, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 3: tile_avx512<3, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 2: tile_avx512<2, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      case 1: tile_avx512<1, W>(x + m * K, K, w, y + m * ldy, ldy); break;
      default: break;
    }
  } else if (isa == AVX2) {
    for (; m + 2 <= M; m += 2) tile_avx2<2, W>(x + m * K, K, w, y + m * ldy, ldy);
    if (m < M) tile_avx2<1, W>(x + m * K, K, w, y + m * ldy, ldy);
  } else {
    for (; m < M; ++m) tile_scalar<W>(x + m * K, K, w, y + m * ldy);
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == NB && x.size(1) == w.size(1),
              "workbench_cpu::linear: x [M, K] and w [N / 32, K, 32] expected");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "fp32 or bf16 weights");
  TORCH_CHECK(isa >= SCALAR && isa <= AVX512, "isa: 0 scalar, 1 avx2, 2 avx512");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0), N = blocks * NB;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor wc = w.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool bf16 = wc.scalar_type() == at::kBFloat16;
  const void* wp = wc.data_ptr();
  if (M > 0) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (bf16)
          block<uint16_t>(static_cast<Isa>(isa), xp, M, K, static_cast<const uint16_t*>(wp) + b * K * NB, yp + b * NB, N);
        else
          block<float>(static_cast<Isa>(isa), xp, M, K, static_cast<const float*>(wp) + b * K * NB, yp + b * NB, N);
      }
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  if (x.scalar_type() == at::kFloat) return y;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fp32 or bf16 activations");
  at::Tensor out = at::empty({M, N}, x.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, M * N, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = float_to_bf16(yp[i]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear", &linear);
}
