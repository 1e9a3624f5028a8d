// workbench_cpu::fp8_gather — rows of an FP8 E4M3 (float8_e4m3fn) paged KV cache, decoded in
// one pass: what the torch path computes as
//     (values.index_select(0, index).to(float32) * scales.index_select(0, index).unsqueeze(-1)).to(dtype)
// with the same bits, without torch's eager float8 -> float32 conversion (about 60x a bf16 copy
// on the CPU).
//
//   values [N, ..., D]  uint8 (or float8_e4m3fn) bytes, contiguous: whole blocks [NB, BS, H, D],
//                       or slots [NB * BS, H, D] (a tree's rows gather key by key);
//   scales [N, ...]     fp32, one per D values, contiguous;
//   index  [M]          int64 (or int32) rows of dim 0, each in [0, N);
//   out    [M, ..., D]  fp32, bf16 or fp16.
//
// Arithmetic, the same on every instruction set:
//   decode:   a 256-entry float table filled by torch's own scalar conversion (exact; e4m3fn
//             has no infinities, 0x7f / 0xff are NaN);
//   scale:    one fp32 multiply, value * scale in that order (no FMA: -ffp-contract=off);
//   convert:  fp32 as is; bf16 rounded to nearest even, a NaN written 0xffff as torch's
//             vectorized conversion writes it; fp16 rounded to nearest even (vcvtps2ph or
//             torch's scalar helper), a NaN quieted with its payload's top bits, as vcvtps2ph.
// The AVX-512 path decodes 16 bytes with 4 two-register permutes of the table's first 128
// entries (entry b | 0x80 is entry b with the sign bit set), the AVX2 path through fp16's
// layout; a row's tail of D % 16 (or D % 8) values takes the scalar code. Threads split rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
enum Out { F32, BF16, F16 };

struct Table {
  alignas(64) float value[256];
  Table() {
    for (int b = 0; b < 256; ++b) value[b] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(b));
  }
};

const Table& table() {
  static const Table t;
  return t;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// cpu_bf16.h's rounding, with torch's NaN (its vectorized conversion writes 0xffff)
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7fffffffu) > 0x7f800000u ? 0xffff : rounded;
}

inline uint16_t to_f16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  return c10::detail::fp16_ieee_from_fp32_value(f);
}

template <Out O> inline void store1(void* out, int64_t i, float v) {
  if constexpr (O == F32) static_cast<float*>(out)[i] = v;
  else if constexpr (O == BF16) static_cast<uint16_t*>(out)[i] = to_bf16(v);
  else static_cast<uint16_t*>(out)[i] = to_f16(v);
}

// values d0 <= d < D of one scale's run: the scalar definition
template <Out O> inline void run_scalar(const uint8_t* src, float s, int64_t d0, int64_t D, void* out) {
  const float* t = table().value;
  for (int64_t d = d0; d < D; ++d) store1<O>(out, d, t[src[d]] * s);
}

// ---- AVX-512: 16 values at a time --------------------------------------------------------
struct Table512 {
  __m512 t[8];            // entries 0..127
};

__attribute__((target("avx512f"))) inline Table512 table512() {
  Table512 r;
  for (int i = 0; i < 8; ++i) r.t[i] = _mm512_loadu_ps(table().value + 16 * i);
  return r;
}

__attribute__((target("avx512f"))) inline __m512 decode16(const Table512& tb, const uint8_t* src) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512 p0 = _mm512_permutex2var_ps(tb.t[0], b, tb.t[1]);      // low 5 bits pick in 0..31
  const __m512 p1 = _mm512_permutex2var_ps(tb.t[2], b, tb.t[3]);      // 32..63
  const __m512 p2 = _mm512_permutex2var_ps(tb.t[4], b, tb.t[5]);      // 64..95
  const __m512 p3 = _mm512_permutex2var_ps(tb.t[6], b, tb.t[7]);      // 96..127
  const __mmask16 bit5 = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x20));
  const __mmask16 bit6 = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x40));
  const __m512 lo = _mm512_mask_blend_ps(bit5, p0, p1), hi = _mm512_mask_blend_ps(bit5, p2, p3);
  const __m512i v = _mm512_castps_si512(_mm512_mask_blend_ps(bit6, lo, hi));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_xor_si512(v, sign));
}

template <Out O>
__attribute__((target("avx512f"))) void run_avx512(const uint8_t* src, float s, int64_t D, void* out,
                                                   const Table512& tb) {
  const __m512 scale = _mm512_set1_ps(s);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m512 y = _mm512_mul_ps(decode16(tb, src + d), scale);
    if constexpr (O == F32) {
      _mm512_storeu_ps(static_cast<float*>(out) + d, y);
    } else if constexpr (O == BF16) {
      const __m512i u = _mm512_castps_si512(y);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0xffff));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + d), _mm512_cvtepi32_epi16(r));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + d),
                          _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  run_scalar<O>(src, s, d, D, out);
}

// ---- AVX2: 8 values at a time ------------------------------------------------------------
// No gather (microcoded and slow on CPUs with the GDS mitigation): a byte's sign and 7 bits
// moved into fp16's layout are the same number over 256 (fp16's exponent bias is 15, e4m3's 7;
// subnormals too), widened exactly by vcvtph2ps and scaled back by 256 exactly. 0x7f / 0xff
// get fp16's all-ones exponent: the NaN 0x7ff00000 (with its sign), the table's.
__attribute__((target("avx2,fma,f16c"))) inline __m256 decode8(const uint8_t* src) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m128i low7 = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00));
  const __m128i h = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                              _mm_slli_epi16(low7, 7)), nan);
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

template <Out O>
__attribute__((target("avx2,fma,f16c"))) void run_avx2(const uint8_t* src, float s, int64_t D, void* out) {
  const __m256 scale = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 y = _mm256_mul_ps(decode8(src + d), scale);
    if constexpr (O == F32) {
      _mm256_storeu_ps(static_cast<float*>(out) + d, y);
    } else if constexpr (O == BF16) {
      const __m256i u = _mm256_castps_si256(y);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), nan);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + d), packed);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + d),
                       _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  run_scalar<O>(src, s, d, D, out);
}

// The rows to decode: output row m is input row index[m], `runs` scales of D values each
struct Rows {
  const uint8_t* values;
  const float* scales;
  const int64_t* index;
  int64_t runs, D, width;   // width: the output's bytes per value
  void* out;
  const uint8_t* src(int64_t m, int64_t r) const { return values + (index[m] * runs + r) * D; }
  float scale(int64_t m, int64_t r) const { return scales[index[m] * runs + r]; }
  void* dst(int64_t m, int64_t r) const { return static_cast<char*>(out) + (m * runs + r) * D * width; }
};

template <Out O> void rows_scalar(const Rows& w, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t r = 0; r < w.runs; ++r) run_scalar<O>(w.src(m, r), w.scale(m, r), 0, w.D, w.dst(m, r));
}

template <Out O> __attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Rows& w, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t r = 0; r < w.runs; ++r) run_avx2<O>(w.src(m, r), w.scale(m, r), w.D, w.dst(m, r));
}

template <Out O> __attribute__((target("avx512f"))) void rows_avx512(const Rows& w, int64_t m0, int64_t m1) {
  const Table512 tb = table512();
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t r = 0; r < w.runs; ++r) run_avx512<O>(w.src(m, r), w.scale(m, r), w.D, w.dst(m, r), tb);
}

template <Out O> void gather_rows(Isa isa, const Rows& w, int64_t m0, int64_t m1) {
  if (isa == AVX512) rows_avx512<O>(w, m0, m1);
  else if (isa == AVX2) rows_avx2<O>(w, m0, m1);
  else rows_scalar<O>(w, m0, m1);
}

at::Tensor fp8_gather(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& index,
                      at::ScalarType dtype, int64_t isa) {
  TORCH_CHECK(values.scalar_type() == at::kByte || values.scalar_type() == at::kFloat8_e4m3fn,
              "workbench_cpu::fp8_gather: values are uint8 or float8_e4m3fn bytes");
  TORCH_CHECK(values.dim() >= 2 && values.is_contiguous(), "fp8_gather: contiguous values [N, ..., D] expected");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.sizes() == values.sizes().slice(0, values.dim() - 1),
              "fp8_gather: contiguous fp32 scales [N, ...] (the values' shape without D) expected");
  TORCH_CHECK(index.dim() == 1 && (index.scalar_type() == at::kLong || index.scalar_type() == at::kInt),
              "fp8_gather: a 1-d int64 or int32 index expected");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fp8_gather: out dtype float32, bfloat16 or float16");
  TORCH_CHECK(isa >= SCALAR && isa <= AVX512, "fp8_gather: isa 0 scalar, 1 avx2, 2 avx512");
  const at::Tensor ids = index.to(at::kLong).contiguous();
  const int64_t M = ids.size(0), N = values.size(0), D = values.size(-1);
  const int64_t runs = N ? scales.numel() / N : 0;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(ip[m] >= 0 && ip[m] < N, "fp8_gather: index ", ip[m], " is out of range for ", N, " rows");
  std::vector<int64_t> shape(values.sizes().begin(), values.sizes().end());
  shape[0] = M;
  at::Tensor out = at::empty(shape, values.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const Rows w{static_cast<const uint8_t*>(values.data_ptr()), scales.data_ptr<float>(), ip, runs, D,
               static_cast<int64_t>(out.element_size()), out.data_ptr()};
  // grain: about 16K values a task, so a small read stays on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, runs * D));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    const Isa which = static_cast<Isa>(isa);
    if (dtype == at::kFloat) gather_rows<F32>(which, w, m0, m1);
    else if (dtype == at::kBFloat16) gather_rows<BF16>(which, w, m0, m1);
    else gather_rows<F16>(which, w, m0, m1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("fp8_gather(Tensor values, Tensor scales, Tensor index, ScalarType dtype, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("fp8_gather", &fp8_gather);
}
