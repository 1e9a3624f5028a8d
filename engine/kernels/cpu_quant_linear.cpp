// workbench_cpu::linear_q — y[M, N] = x[M, K] @ W^T (+ bias) for weight-only quantized weights:
// 4-bit (groups of 32 along K: Q4_0, Q4_1, Q4_K, AWQ, GPTQ), 5-bit (groups of 32: Q5_0, Q5_1) or 8-bit (groups of 32: Q8_0, or of
// 16: Q6_K), with the activations quantized per row to int8 in blocks of 32.
//
// Arithmetic (the same on every instruction set, for every row count):
//   activations, per row and block of 32:  sx = amax / 127,  xq = round_even(x * (127 / amax))
//   weights, per column and group of G:    w = d * u + m,  u an unsigned integer (4 or 8 bits)
//   per group, in order over K:            U   = sum(u * xq)              (exact, int32)
//                                          acc = fma(float(U), d * sx, acc)
//                                          acc = fma(m, sx * float(sum(xq)), acc)
// A 4-bit format's zero point lives in m; an 8-bit q in -128..127 is stored as u = q + 128 with
// m = -128 d (Q6_K: u = q6 in 0..63, m = -32 d). U is an integer, so how a path computes it does
// not matter: AVX-512 VNNI (vpdpbusd on 512 bits), AVX-VNNI (vpdpbusd on 256), AVX2 (vpmaddubsw +
// vpmaddwd, no saturation: bounded below) and scalar code give the same U, then the same float
// steps. Vectors run across
// output columns, never across k, so a row's bits depend neither on the row count nor on the
// instruction set nor on the thread count (threads split column tiles, never K). Each weight
// tile is decoded once per call for every group of rows that uses it (llama.cpp's CPU method,
// written for this project): on AVX-512, 5 to 8 rows in one group over one tile, past 8 groups of
// 8 (then the rest) over one tile, up to 4 rows in a group; on the 256-bit paths
// (cpu_quant_tile256.h) groups of up to 8.
// AVX-512 keeps a 4-bit tile read by more than one group decoded for the later groups, where
// the 256-bit paths re-decode it from L1 (faster there).
//
// Packed layout, per tile of 16 output columns (t = N / 16) and group g of G k:
//   4-bit (G = 32): w[t, g, 256] uint8, byte j*64 + c*4 + i (j < 4, c < 16, i < 4) holds
//                   u[c][32g + 4j + i] in its low nibble and u[c][32g + 16 + 4j + i] in its high;
//   5-bit (G = 32): the 4-bit layout's 256 bytes of low nibbles, then bit 4 of each value as bit
//                   planes (Q5_0, Q5_1; a Q5_K group's body): w[t, g, 320];
//   8-bit:          w[t, g, G*16] uint8, byte j*64 + c*4 + i holds u[c][Gg + 4j + i];
//   scales[t, g, 2, 16] (fp16 or fp32): d of the 16 columns, then m.
//
// llama.cpp's K-quants, read as stored (group 256 names them; bits 4, 5, 6 = Q4_K, Q5_K, Q6_K):
// the file's bits a weight, repacked at load into tiles of 16 columns, never widened. Per tile
// and super-block of 256 k, w[t, sb, bytes] (bytes: 2304, 2816, 3360 = 16 x the file's 144,
// 176, 210), no scales tensor:
//   8 groups of 32 k, each: 256 bytes of nibbles (the 4-bit layout above), then the high bits
//     as bit planes (Q5_K: bit 4; Q6_K: bits 4 and 5): per j < 4 a 64-bit mask per plane over
//     the 64 bytes of j (bit c*4 + i), low nibbles' planes first, then the high nibbles';
//   the scales as the file stores them, regrouped by column:
//     Q4_K, Q5_K: per group 16 bytes (column c: 6-bit sc's and m's low 4 bits, sc | m << 4) and
//       8 bytes (byte c < 8: column c's top 2 bits of sc | m << 2 in its low nibble, column
//       c + 8's in its high one); then d [16] and dmin [16] in fp16;
//     Q6_K: int8 sc [16 sub-blocks of 16][16 columns], then d [16] in fp16.
// Decoded in registers once a super-block: Q4_K / Q5_K w = d*sc * u - dmin*m per group of 32
// (u = q, 0..15 / 0..31); Q6_K w = d*sc * u - 32 d*sc per sub-block of 16 (u = q, 0..63), the
// two sub-blocks of a group of 32 being its low and its high nibbles. Each product is exact in
// fp32, so the arithmetic above with G = 32 (Q6_K: 16) and these d, m gives the bits of the
// widened weight with fp32 scales.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "cpu_bf16.h"
#include "cpu_fused.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t COLS = 16, XB = 32;
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX_VNNI = 3, AVX512VL_VNNI = 4 };

using workbench_bf16::bf16_to_float;
using workbench_bf16::float_to_bf16;

// ---- activations ---------------------------------------------------------------------------
struct Rows {
  const int8_t* xq;        // [M, K]
  const float* sx;         // [M, K / 32]
  const float* sxs;        // [M, K / G]: sx * sum(xq) over each weight group
  const int32_t* xsum;     // [M, K / G]: sum(xq) over each weight group
  int64_t K, G;
  // the same xq, rows four by four, each group of 4 k of the 4 rows side by side:
  // [ceil(M / 4), K / 4, 4 rows, 4] (the last group's missing rows zero). A 256-bit tile reads
  // every row's bytes from one pointer at fixed offsets (no address per row).
  const int8_t* xq4;
};

// xq [M, K] -> Rows::xq4's layout
inline void interleave4(const int8_t* xq, int64_t M, int64_t K, int8_t* xq4) {
  for (int64_t i0 = 0; i0 < M; i0 += 4) {
    int8_t* out = xq4 + i0 * K;
    for (int64_t c = 0; c < K / 4; ++c)
      for (int64_t r = 0; r < 4; ++r) {
        if (i0 + r < M) std::memcpy(out + c * 16 + r * 4, xq + (i0 + r) * K + c * 4, 4);
        else std::memset(out + c * 16 + r * 4, 0, 4);
      }
  }
}

inline float round_even(float v) {     // |v| <= 127 < 2^22: the classic shift, no libm call (IEEE
  constexpr float shift = 12582912.0f;  // arithmetic: without -ffast-math the compiler keeps both steps)
  return (v + shift) - shift;
}

// Per weight group: sum(xq), and sx * sum(xq) (the zero point's weight)
inline void group_sums(const int8_t* xq, int64_t K, int64_t G, const float* sx, float* sxs, int32_t* xsum) {
  for (int64_t g = 0; g < K / G; ++g) {
    int32_t s = 0;
    for (int64_t i = 0; i < G; ++i) s += xq[g * G + i];
    xsum[g] = s;
    sxs[g] = sx[g * G / XB] * static_cast<float>(s);
  }
}

// One row: the scalar definition. The AVX-512 variant below must give the same bytes.
void quantize_row_scalar(const float* x, int64_t K, int64_t G, int8_t* xq, float* sx, float* sxs, int32_t* xsum) {
  for (int64_t b = 0; b < K / XB; ++b) {
    const float* xb = x + b * XB;
    float amax = 0.0f;
    for (int i = 0; i < XB; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    sx[b] = amax / 127.0f;
    for (int i = 0; i < XB; ++i) {
      float q = round_even(xb[i] * inv);
      q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
      xq[b * XB + i] = static_cast<int8_t>(q);
    }
  }
  group_sums(xq, K, G, sx, sxs, xsum);
}

__attribute__((target("avx512f,avx512bw")))
void quantize_row_avx512(const float* x, int64_t K, int64_t G, int8_t* xq, float* sx, float* sxs, int32_t* xsum) {
  for (int64_t b = 0; b < K / XB; ++b) {
    __m512 v0 = _mm512_loadu_ps(x + b * XB), v1 = _mm512_loadu_ps(x + b * XB + 16);
    // max of |x|: exact in any order (NaN aside)
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    sx[b] = amax / 127.0f;
    const __m512 iv = _mm512_set1_ps(inv), lim = _mm512_set1_ps(127.0f);
    // cvtps rounds to nearest even (MXCSR default), as round_even does
    __m512i q0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(v0, iv), 0x08), lim), -lim));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_roundscale_ps(_mm512_mul_ps(v1, iv), 0x08), lim), -lim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * XB), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * XB + 16), _mm512_cvtepi32_epi8(q1));
  }
  group_sums(xq, K, G, sx, sxs, xsum);
}

__attribute__((target("avx2,fma")))
void quantize_row_avx2(const float* x, int64_t K, int64_t G, int8_t* xq, float* sx, float* sxs, int32_t* xsum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / XB; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * XB + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    sx[b] = amax / 127.0f;
    const __m256 iv = _mm256_set1_ps(inv), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(
          _mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lim), nlim));
    // int32 -> int8 in order: the packs work per 128-bit lane, a final permute restores it
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * XB), bytes);
  }
  group_sums(xq, K, G, sx, sxs, xsum);
}

// ---- bf16 in and out: the scalar conversions of cpu_bf16.h, eight at a time (the same bits;
// one call's M x N outputs made the scalar loop cost as much as the 8-row tiles' fmas) --------
__attribute__((target("avx2")))
void widen_bf16_avx2(const uint16_t* h, float* out, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k)));
    _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
  for (; k < n; ++k) out[k] = bf16_to_float(h[k]);
}

// 8 values of y (+ bias) (+ a bf16 residual, after y + bias is rounded to bf16) -> their bf16
// bits in the low half of each 32-bit lane
__attribute__((target("avx2"))) inline __m256i narrow8_bf16(const float* y, const float* bias, const uint16_t* res) {
  __m256 v = _mm256_loadu_ps(y);
  if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
  if (res) {
    const __m256i r = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(res))), 16);
    v = _mm256_add_ps(workbench_fused::round8_bf16(v), _mm256_castsi256_ps(r));
  }
  return _mm256_srli_epi32(_mm256_castps_si256(workbench_fused::round8_bf16(v)), 16);
}

// out[n] = bf16(y[n] (+ bias[n])): the sum in fp32, then rounded once to nearest even; with a
// residual, bf16(res[n] + that)
inline uint16_t finish_bf16(float y, const float* bias, const uint16_t* res, int64_t n) {
  const float v = bias ? y + bias[n] : y;
  return res ? float_to_bf16(bf16_to_float(res[n]) + bf16_to_float(float_to_bf16(v))) : float_to_bf16(v);
}

__attribute__((target("avx2")))
void narrow_bf16_avx2(const float* y, const float* bias, const uint16_t* res, uint16_t* out, int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256i packed = _mm256_packus_epi32(narrow8_bf16(y + k, bias ? bias + k : nullptr, res ? res + k : nullptr),
                                               narrow8_bf16(y + k + 8, bias ? bias + k + 8 : nullptr,
                                                            res ? res + k + 8 : nullptr));   // per 128-bit lane
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; k < n; ++k) out[k] = finish_bf16(y[k], bias, res, k);
}

// ---- scales --------------------------------------------------------------------------------
template <typename S> inline float scale_at(const S* p, int64_t i);
template <> inline float scale_at<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float scale_at<at::Half>(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename S> __attribute__((target("avx512f"))) inline __m512 scales16_512(const S* p);
template <> __attribute__((target("avx512f"))) inline __m512 scales16_512<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <> __attribute__((target("avx512f"))) inline __m512 scales16_512<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename S> __attribute__((target("avx2,fma,f16c"))) inline __m256 scales8_256(const S* p);
template <> __attribute__((target("avx2,fma,f16c"))) inline __m256 scales8_256<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <> __attribute__((target("avx2,fma,f16c"))) inline __m256 scales8_256<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

struct Weight {
  const uint8_t* w;        // the tile's first byte
  const void* s;           // the tile's first scale
  int64_t wstride, sstride;   // bytes / scales from one tile to the next
};

constexpr int64_t group_bytes(int BITS, int64_t G) { return BITS == 4 ? 256 : BITS == 5 ? 320 : G * 16; }

// Formats (the kernels' template argument F): 4 and 8 as above, and the K-quants.
constexpr int KQ4 = 14, KQ5 = 15, KQ6 = 16;
constexpr bool kfmt(int F) { return F >= KQ4; }
constexpr int planes(int F) { return F == KQ5 || F == 5 ? 1 : F == KQ6 ? 2 : 0; }
constexpr int64_t kgroup_bytes(int F) { return 256 + 64 * planes(F); }         // a group of 32 k
constexpr int64_t kscale_bytes(int F) { return F == KQ6 ? 16 * COLS + 2 * COLS : 8 * 24 + 4 * COLS; }
constexpr int64_t ksb_bytes(int F) { return 8 * kgroup_bytes(F) + kscale_bytes(F); }
constexpr int ksubs(int F) { return F == KQ6 ? 2 : 1; }                       // scales per group of 32
constexpr int kformat(int64_t bits) { return bits == 4 ? KQ4 : bits == 5 ? KQ5 : KQ6; }

// A super-block's scales of one tile -> dm[group of 32][sub-block][d, m][16 columns] in fp32
// (exact products). The scalar definition and its 8-lane form (every SIMD path has AVX2).
template <int F>
inline void kscale_scalar(const uint8_t* s, int sub, int c, float* d_out, float* m_out) {
  auto half_at = [&](int64_t at) { at::Half h; std::memcpy(&h, s + at, 2); return static_cast<float>(h); };
  if constexpr (F == KQ6) {
    const float dsc = static_cast<float>(static_cast<int8_t>(s[sub * COLS + c])) * half_at(16 * COLS + 2 * c);
    *d_out = dsc;
    *m_out = dsc * -32.0f;
  } else {
    const uint8_t lo = s[sub * 24 + c], hb = s[sub * 24 + 16 + (c & 7)];
    const int hn = c < 8 ? hb & 15 : hb >> 4;
    const int sc = (lo & 15) | ((hn & 3) << 4), mn = (lo >> 4) | ((hn >> 2) << 4);
    *d_out = static_cast<float>(sc) * half_at(8 * 24 + 2 * c);
    *m_out = static_cast<float>(mn) * -half_at(8 * 24 + 2 * COLS + 2 * c);
  }
}

template <int F>
__attribute__((target("avx2,fma,f16c")))
void kscales_avx2(const uint8_t* s, float* dm) {
  for (int h = 0; h < 2; ++h) {
    if constexpr (F == KQ6) {
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * COLS + h * 16)));
      for (int sub = 0; sub < 16; ++sub) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + sub * COLS + h * 8)));
        const __m256 dsc = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d8);
        _mm256_storeu_ps(dm + sub * 2 * COLS + h * 8, dsc);
        _mm256_storeu_ps(dm + sub * 2 * COLS + COLS + h * 8, _mm256_mul_ps(dsc, _mm256_set1_ps(-32.0f)));
      }
    } else {
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8 * 24 + h * 16)));
      const __m256 nmin8 = _mm256_xor_ps(_mm256_set1_ps(-0.0f),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8 * 24 + 2 * COLS + h * 16))));
      const __m256i f4 = _mm256_set1_epi32(15), f2 = _mm256_set1_epi32(3);
      for (int g = 0; g < 8; ++g) {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + g * 24 + h * 8)));
        const __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + g * 24 + 16)));
        const __m256i hn = h ? _mm256_srli_epi32(hb, 4) : _mm256_and_si256(hb, f4);
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(lo, f4), _mm256_slli_epi32(_mm256_and_si256(hn, f2), 4));
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4), _mm256_slli_epi32(_mm256_srli_epi32(hn, 2), 4));
        _mm256_storeu_ps(dm + g * 2 * COLS + h * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d8));
        _mm256_storeu_ps(dm + g * 2 * COLS + COLS + h * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(mn), nmin8));
      }
    }
  }
}

// The tile's group g of 32 k: its nibbles (then its bit planes)
template <int F>
inline const uint8_t* kgroup(const uint8_t* tile, int64_t g) {
  return tile + (g >> 3) * ksb_bytes(F) + (g & 7) * kgroup_bytes(F);
}
template <int F>
inline const uint8_t* kscales_of(const uint8_t* tile, int64_t g) {      // g: any group of the super-block
  return tile + (g >> 3) * ksb_bytes(F) + 8 * kgroup_bytes(F);
}

// A super-block's d (and -dmin) for 16 columns, and one group's (sub-block's) d, m from them:
// kscales_avx2's values, 16 lanes at a time, computed as the group is finished (no stores)
template <int F>
__attribute__((target("avx512f,avx512bw,f16c")))
inline void ksuper16(const uint8_t* s, __m512* d16, __m512* nmin16) {
  *d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (F == KQ6 ? 16 * COLS : 8 * 24))));
  if constexpr (F != KQ6)
    *nmin16 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(0x80000000u)), _mm512_castps_si512(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8 * 24 + 2 * COLS))))));
}

template <int F>
__attribute__((target("avx512f,avx512bw,f16c")))
inline void kgroup16(const uint8_t* s, int sub, __m512 d16, __m512 nmin16, __m512* dv, __m512* mv) {
  if constexpr (F == KQ6) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + sub * COLS)));
    *dv = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d16);
    *mv = _mm512_mul_ps(*dv, _mm512_set1_ps(-32.0f));
  } else {
    const __m512i f4 = _mm512_set1_epi32(15), f2 = _mm512_set1_epi32(3);
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + sub * 24)));
    const __m128i h8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + sub * 24 + 16));
    const __m512i hb = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(h8, h8));    // column c < 8: byte c, else c - 8
    const __m512i hn = _mm512_and_si512(_mm512_srlv_epi32(hb, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0,
                                                                                  4, 4, 4, 4, 4, 4, 4, 4)), f4);
    const __m512i sc = _mm512_or_si512(_mm512_and_si512(lo, f4), _mm512_slli_epi32(_mm512_and_si512(hn, f2), 4));
    const __m512i mn = _mm512_or_si512(_mm512_srli_epi32(lo, 4), _mm512_slli_epi32(_mm512_srli_epi32(hn, 2), 4));
    *dv = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d16);
    *mv = _mm512_mul_ps(_mm512_cvtepi32_ps(mn), nmin16);
  }
}

// The first row group of a call streams its tiles from memory, prefetching this far ahead in the
// tile's own bytes (the next tile's follow them). A 2-core Zen 4 (memory ~30 GB/s a thread):
// the model's K-quant linears at one row streamed 12 GB/s a thread with the next tile's group
// prefetched, 20 GB/s 8 KiB ahead (4 KiB: 16, 16 KiB: 19, into L2: 13); AVX2's path 10 at
// 2 KiB, 14 at 4 and 8 KiB.
constexpr int64_t PREFETCH_BYTES = 8192;

// ---- AVX-512 VNNI: T tiles (16 columns each) by R rows at once -----------------------------
// F: 4, 8, or a K-quant (S is then float: the super-block's scales decoded into dm)
template <int F, int R, int T, typename S>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
void tile_vnni(const Rows& rows, int64_t row0, const Weight& wt, float* y, int64_t ldy, bool prefetch_next = false,
               uint8_t* unpack_to = nullptr) {
  constexpr bool KF = kfmt(F), NIB = F != 8, SPLIT = F == KQ6;
  constexpr int PL = planes(F);
  constexpr int P = (R * T <= 4 || SPLIT) ? 2 : 1;
  const int64_t K = rows.K, G = rows.G, xblocks = K / XB, sums = K / G;
  const int64_t groups = NIB ? K / 32 : K / G, gb = KF ? kgroup_bytes(F) : group_bytes(F, G);
  const __m512i low = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(16), b5 = _mm512_set1_epi8(32);
  const S* sc = static_cast<const S*>(wt.s);
  __m512 d16[T], nmin16[T];      // a K-quant's super-block scales, per tile
  auto wgroup = [&](int t, int64_t g) {
    const uint8_t* tile = wt.w + t * wt.wstride;
    if constexpr (KF) return kgroup<F>(tile, g);
    else return tile + g * gb;
  };
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (KF) {
      if ((g & 7) == 0)
        for (int t = 0; t < T; ++t) ksuper16<F>(kscales_of<F>(wt.w + t * wt.wstride, g), &d16[t], &nmin16[t]);
    }
    // P integer chains per output (added exactly at the end) keep enough vpdpbusd in flight
    // when few rows share a tile; Q6_K's two chains are its two sub-blocks
    __m512i isum[R][T][P];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        for (int p = 0; p < P; ++p) isum[r][t][p] = _mm512_setzero_si512();
    const int8_t* xg = rows.xq + row0 * K + g * (NIB ? 32 : G);
    if (prefetch_next) {      // PREFETCH_BYTES ahead in the stream this tile is read from (the next tile follows it)
      for (int t = 0; t < T; ++t) {
        const uint8_t* ahead = wgroup(t, g) + PREFETCH_BYTES;
        for (int64_t line = 0; line < gb; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        if constexpr (KF) {
          if ((g & 7) == 0)
            for (int64_t line = 0; line < kscale_bytes(F); line += 64)
              _mm_prefetch(reinterpret_cast<const char*>(kscales_of<F>(wt.w + t * wt.wstride, g) + PREFETCH_BYTES + line), _MM_HINT_T0);
        } else {
          _mm_prefetch(reinterpret_cast<const char*>(sc + t * wt.sstride + g * 2 * COLS) + PREFETCH_BYTES / 4, _MM_HINT_T0);
        }
      }
    }
    if constexpr (NIB) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i lo[T], hi[T];
        for (int t = 0; t < T; ++t) {
          const uint8_t* wg = wgroup(t, g);
          const __m512i v = _mm512_loadu_si512(wg + j * 64);
          lo[t] = _mm512_and_si512(v, low);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          if constexpr (PL > 0) {      // the high bits: a byte mask per plane
            const uint8_t* pl = wg + 256 + j * 16 * PL;
            uint64_t m[2 * PL];
            std::memcpy(m, pl, sizeof(m));
            lo[t] = _mm512_mask_add_epi8(lo[t], m[0], lo[t], b4);
            hi[t] = _mm512_mask_add_epi8(hi[t], m[PL], hi[t], b4);
            if constexpr (PL == 2) {
              lo[t] = _mm512_mask_add_epi8(lo[t], m[1], lo[t], b5);
              hi[t] = _mm512_mask_add_epi8(hi[t], m[3], hi[t], b5);
            }
          }
          if constexpr (F == 4) {
            if (unpack_to) {    // the 8-bit layout of the same u: later row groups skip the decode
              uint8_t* out = unpack_to + t * groups * 32 * COLS + g * 32 * COLS;
              _mm512_storeu_si512(out + j * 64, lo[t]);
              _mm512_storeu_si512(out + (j + 4) * 64, hi[t]);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          int32_t a, c;
          std::memcpy(&a, xg + r * K + 4 * j, 4);
          std::memcpy(&c, xg + r * K + 16 + 4 * j, 4);
          const __m512i xa = _mm512_set1_epi32(a), xc = _mm512_set1_epi32(c);
          for (int t = 0; t < T; ++t) {
            isum[r][t][0] = _mm512_dpbusd_epi32(isum[r][t][0], lo[t], xa);
            isum[r][t][P - 1] = _mm512_dpbusd_epi32(isum[r][t][P - 1], hi[t], xc);
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < G / 4; ++j) {
        __m512i v[T];
        for (int t = 0; t < T; ++t) v[t] = _mm512_loadu_si512(wt.w + t * wt.wstride + g * gb + j * 64);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, xg + r * K + 4 * j, 4);
          const __m512i xa = _mm512_set1_epi32(a);
          for (int t = 0; t < T; ++t) isum[r][t][j % P] = _mm512_dpbusd_epi32(isum[r][t][j % P], v[t], xa);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      for (int sub = 0; sub < ksubs(F); ++sub) {
        __m512 dv, mv;
        if constexpr (KF) {
          kgroup16<F>(kscales_of<F>(wt.w + t * wt.wstride, g), (g & 7) * ksubs(F) + sub, d16[t], nmin16[t], &dv, &mv);
        } else {
          const S* s = sc + t * wt.sstride + g * 2 * COLS;
          dv = scales16_512<S>(s);
          mv = scales16_512<S>(s + COLS);
        }
        for (int r = 0; r < R; ++r) {
          const float sx = rows.sx[(row0 + r) * xblocks + (NIB ? g : g * G / XB)];
          const float sxs = rows.sxs[(row0 + r) * sums + g * ksubs(F) + sub];
          const __m512i u = SPLIT ? isum[r][t][sub]
                            : P == 2 ? _mm512_add_epi32(isum[r][t][0], isum[r][t][P - 1]) : isum[r][t][0];
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), _mm512_mul_ps(dv, _mm512_set1_ps(sx)), acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sxs), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + r * ldy + t * COLS, acc[r][t]);
}

// ---- 256-bit: AVX2, AVX-VNNI, and AVX-VNNI's code in AVX-512 VL's encoding -----------------
// One body (cpu_quant_tile256.h), compiled once per instruction set: the EVEX build lets an
// AVX-512 machine run and test the code an AVX-VNNI one (Alder Lake and later) runs.

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define TILE256 TileAvx2
#define DOT_VNNI 0
#include "cpu_quant_tile256.h"
#undef TILE256
#undef DOT_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define TILE256 TileAvxVnni
#define DOT_VNNI 1
#include "cpu_quant_tile256.h"
#undef TILE256
#undef DOT_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define TILE256 TileAvx512VlVnni
#define DOT_VNNI 1
#include "cpu_quant_tile256.h"
#undef TILE256
#undef DOT_VNNI
#pragma GCC pop_options

// ---- scalar: the definition -----------------------------------------------------------------
template <int F, typename S>
void tile_scalar(const Rows& rows, int64_t row, const Weight& wt, float* y) {
  constexpr bool KF = kfmt(F), NIB = F != 8;
  constexpr int PL = planes(F);
  const int64_t K = rows.K, G = rows.G, xblocks = K / XB, sums = K / G;
  const int64_t groups = NIB ? K / 32 : K / G, gb = group_bytes(F, G);
  const S* sc = static_cast<const S*>(wt.s);
  auto bit = [](const uint8_t* plane, int b) { return (plane[b >> 3] >> (b & 7)) & 1; };
  for (int c = 0; c < COLS; ++c) {
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* xg = rows.xq + row * K + g * (NIB ? 32 : G);
      const uint8_t* wg = KF ? kgroup<F>(wt.w, g) : wt.w + g * gb;
      int32_t u[2] = {0, 0};            // the group's dot (Q6_K: its two sub-blocks')
      for (int j = 0; j < (NIB ? 4 : G / 4); ++j)
        for (int i = 0; i < 4; ++i) {
          const int b = c * 4 + i;
          const uint8_t byte = wg[j * 64 + b];
          if constexpr (NIB) {
            int ulo = byte & 0x0F, uhi = byte >> 4;
            for (int p = 0; p < PL; ++p) {
              ulo |= bit(wg + 256 + j * 16 * PL + p * 8, b) << (4 + p);
              uhi |= bit(wg + 256 + j * 16 * PL + (PL + p) * 8, b) << (4 + p);
            }
            u[0] += ulo * xg[4 * j + i];
            u[F == KQ6 ? 1 : 0] += uhi * xg[16 + 4 * j + i];
          } else {
            u[0] += static_cast<int32_t>(byte) * xg[4 * j + i];
          }
        }
      for (int sub = 0; sub < ksubs(F); ++sub) {
        float d, m;
        if constexpr (KF) {
          kscale_scalar<F>(kscales_of<F>(wt.w, g), (g & 7) * ksubs(F) + sub, c, &d, &m);
        } else {
          d = scale_at<S>(sc, g * 2 * COLS + c);
          m = scale_at<S>(sc, g * 2 * COLS + COLS + c);
        }
        const float sx = rows.sx[row * xblocks + (NIB ? g : g * G / XB)], sxs = rows.sxs[row * sums + g * ksubs(F) + sub];
        acc = std::fma(static_cast<float>(u[sub]), d * sx, acc);
        acc = std::fma(m, sxs, acc);
      }
    }
    y[c] = acc;
  }
}

// ---- one call ------------------------------------------------------------------------------
// The first row group streams the weights (prefetching the next tiles) and, for 4-bit weights
// read by more than one row group, leaves them decoded to bytes in `scratch` for the others:
// the same integers u, so the same U and the same bits.
template <int BITS, typename S, int T>
void vnni_rows(const Rows& rows, int64_t M, const Weight& wt, float* y, int64_t ldy, uint8_t* scratch) {
  const int64_t groups = rows.K / rows.G;
  const bool reuse = BITS == 4 && M > 4;
  const Weight decoded{scratch, wt.s, groups * 32 * COLS, wt.sstride};
  int64_t i = 0;
  auto group_of = [&](auto rows_now) {
    constexpr int RN = decltype(rows_now)::value;
    if (i == 0) tile_vnni<BITS, RN, T, S>(rows, i, wt, y, ldy, true, reuse ? scratch : nullptr);
    else if constexpr (BITS == 4) {
      if (reuse) tile_vnni<8, RN, T, S>(rows, i, decoded, y + i * ldy, ldy);
      else tile_vnni<BITS, RN, T, S>(rows, i, wt, y + i * ldy, ldy);
    } else {
      tile_vnni<BITS, RN, T, S>(rows, i, wt, y + i * ldy, ldy);
    }
    i += RN;
  };
  if constexpr (T == 1 && BITS != KQ6) {
    // past 9 rows: eight at a time over the tile, as one pass takes 5 to 9 (groups of 4
    // decoded the tile a third time for the ninth row; a group of 1 after 8 cost 0.56 of a
    // one-row call on a 4-bit 3072 x 576 weight, Zen 4)
    while (M - i >= 8 && M - i != 9) group_of(std::integral_constant<int, 8>{});
    if (M - i == 9) group_of(std::integral_constant<int, 9>{});
    if (M - i == 7) group_of(std::integral_constant<int, 7>{});
    if (M - i == 6) group_of(std::integral_constant<int, 6>{});
    if (M - i == 5) group_of(std::integral_constant<int, 5>{});
  }
  while (i + 4 <= M) group_of(std::integral_constant<int, 4>{});
  if (M - i == 3) group_of(std::integral_constant<int, 3>{});
  if (M - i == 2) group_of(std::integral_constant<int, 2>{});
  if (M - i == 1) group_of(std::integral_constant<int, 1>{});
}

// 5 to 9 rows on one tile (16 columns) at once: R accumulators and R integer sums fit the 32
// registers where two tiles' would not (Q6_K's two sums a row would not: it keeps groups of 4)
template <int BITS, typename S>
void vnni_one_pass(const Rows& rows, int64_t M, const Weight& wt, float* y, int64_t ldy) {
  if (M == 5) tile_vnni<BITS, 5, 1, S>(rows, 0, wt, y, ldy, true);
  else if (M == 6) tile_vnni<BITS, 6, 1, S>(rows, 0, wt, y, ldy, true);
  else if (M == 7) tile_vnni<BITS, 7, 1, S>(rows, 0, wt, y, ldy, true);
  else if (M == 8) tile_vnni<BITS, 8, 1, S>(rows, 0, wt, y, ldy, true);
  else tile_vnni<BITS, 9, 1, S>(rows, 0, wt, y, ldy, true);
}

// 256-bit: rows eight at a time, then the rest in one group, each group of rows in one pass over
// the tile (a verify pass of 4 drafts is 5 rows: one pass); the first streams the tile from
// memory (prefetching the tiles ahead), the others re-read it from L1 (re-decoding costs less
// here than reading a decoded copy: measured)
template <typename Tile, int BITS, typename S>
void rows256(const Rows& rows, int64_t M, const Weight& wt, float* y, int64_t ldy) {
  int64_t i = 0;
  auto group_of = [&](auto rows_now) {
    constexpr int RN = decltype(rows_now)::value;
    Tile::template tile<BITS, RN, S>(rows, i, wt, y + i * ldy, ldy, i == 0);
    i += RN;
  };
  if constexpr (BITS == KQ6) {    // two sums a row (its sub-blocks): four rows keep them in registers
    while (i + 4 <= M) group_of(std::integral_constant<int, 4>{});
  } else {
    while (i + 8 <= M) group_of(std::integral_constant<int, 8>{});
    if (M - i == 7) group_of(std::integral_constant<int, 7>{});
    if (M - i == 6) group_of(std::integral_constant<int, 6>{});
    if (M - i == 5) group_of(std::integral_constant<int, 5>{});
  }
  if (M - i == 4) group_of(std::integral_constant<int, 4>{});
  if (M - i == 3) group_of(std::integral_constant<int, 3>{});
  if (M - i == 2) group_of(std::integral_constant<int, 2>{});
  if (M - i == 1) group_of(std::integral_constant<int, 1>{});
}

template <int BITS, typename S>
void run_tiles(Isa isa, const Rows& rows, int64_t M, int64_t t0, int64_t t1, const Weight& base, float* y, int64_t N) {
  const S* s0 = static_cast<const S*>(base.s);
  auto at = [&](int64_t t) {
    return Weight{base.w + t * base.wstride, s0 ? s0 + t * base.sstride : nullptr, base.wstride, base.sstride};
  };
  int64_t t = t0;
  if constexpr (BITS != KQ6) {
    if (isa == AVX512 && M >= 5 && M <= 9) {
      // a verify pass (k + 1 rows) or a few users: every row in one pass over each tile, so the
      // tile is read and decoded once (in groups of 4, the fifth row cost 0.65 of a step more)
      for (; t < t1; ++t) vnni_one_pass<BITS, S>(rows, M, at(t), y + t * COLS, N);
      return;
    }
  }
  if (isa == AVX512) {
    static thread_local std::vector<uint8_t> scratch;       // each worker thread's decoded tiles
    scratch.resize(BITS == 4 && M > 4 ? 2 * (rows.K / 32) * 32 * COLS : 0);
    // one tile at a time: one stream from memory, prefetched ahead (two tiles side by side
    // were two streams 18 to 55 KiB apart, and streamed at 0.7 of one)
    for (; t < t1; ++t) vnni_rows<BITS, S, 1>(rows, M, at(t), y + t * COLS, N, scratch.data());
  } else if (isa == AVX2) {
    for (; t < t1; ++t) rows256<TileAvx2, BITS, S>(rows, M, at(t), y + t * COLS, N);
  } else if (isa == AVX_VNNI) {
    for (; t < t1; ++t) rows256<TileAvxVnni, BITS, S>(rows, M, at(t), y + t * COLS, N);
  } else if (isa == AVX512VL_VNNI) {
    for (; t < t1; ++t) rows256<TileAvx512VlVnni, BITS, S>(rows, M, at(t), y + t * COLS, N);
  } else {
    for (; t < t1; ++t)
      for (int64_t i = 0; i < M; ++i) tile_scalar<BITS, S>(rows, i, at(t), y + i * N + t * COLS);
  }
}

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& bias, int64_t bits, int64_t group, int64_t isa,
                    const c10::optional<at::Tensor>& norm, double eps, bool glu,
                    const c10::optional<at::Tensor>& residual) {
  // isa: a path, or a plan (engine.kernels.cpu_quant_paths): few | many << 4 | from << 8, the
  // path `many` from `from` rows (every path gives the same bits: only the speed differs).
  // norm (the weight of an RMSNorm with `eps`) or glu (x is [gate | up], SwiGLU) prepare each
  // row first; residual [M, N] is added last (cpu_fused.h)
  if (isa > 15) isa = x.dim() == 2 && x.size(0) >= (isa >> 8) ? (isa >> 4) & 15 : isa & 15;
  const bool kq = group == 256;         // a K-quant's super-blocks, read as stored
  TORCH_CHECK(kq ? (bits >= 4 && bits <= 6) : (bits == 4 || bits == 5 || bits == 8),
              "workbench_cpu::linear_q: bits is 4, 5 or 8, or 4, 5, 6 with group 256 (Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(kq || (bits == 8 ? (group == 32 || group == 16) : group == 32),
              "linear_q: groups of 32 (4- and 5-bit), 32 or 16 (8-bit), 256 (K-quants)");
  const int fmt = kq ? kformat(bits) : static_cast<int>(bits);
  const int64_t unit = kq ? (fmt == KQ4 ? ksb_bytes(KQ4) : fmt == KQ5 ? ksb_bytes(KQ5) : ksb_bytes(KQ6))
                          : group_bytes(bits, group);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == unit,
              "linear_q: x [M, K] and w [N / 16, K / group, ", unit, "] uint8 expected",
              kq ? " (K-quant super-blocks: 16 x the file's bytes a block)" : "");
  const bool normed = norm.has_value() && norm->defined(), added = residual.has_value() && residual->defined();
  TORCH_CHECK(!(normed && glu), "linear_q: a norm or a gated activation before the product, not both");
  TORCH_CHECK(x.size(1) == w.size(1) * group * (glu ? 2 : 1) && w.size(1) * group % XB == 0,
              "linear_q: x's K does not match the weight's", glu ? " (twice it: [gate | up])" : "");
  TORCH_CHECK(kq ? scales.numel() == 0 :
              scales.dim() == 4 && scales.size(0) == w.size(0) && scales.size(1) == w.size(1) && scales.size(2) == 2 &&
              scales.size(3) == COLS, "linear_q: scales [N / 16, K / group, 2, 16] expected (none for a K-quant)");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf || kq, "linear_q: fp32 or fp16 scales");
  TORCH_CHECK(isa >= SCALAR && isa <= AVX512VL_VNNI, "linear_q: isa 0 scalar, 1 avx2, 2 avx512 (VNNI), 3 avx_vnni, 4 avx512vl_vnni");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_q: fp32 or bf16 activations");
  if (kq) group = bits == 6 ? 16 : 32;  // the activations' sums go by the scales' groups
  const int64_t M = x.size(0), Kin = x.size(1), K = glu ? Kin / 2 : Kin, tiles = w.size(0), N = tiles * COLS,
                groups = K / group;
  // bf16 in and out without a torch conversion per call (a decode step makes 121 of these calls)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scales.contiguous();
  TORCH_CHECK(!normed || (norm->dim() == 1 && norm->size(0) == K), "linear_q: the norm's weight is [K]");
  TORCH_CHECK(!added || (residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                         residual->scalar_type() == x.scalar_type()),
              "linear_q: the residual is [M, N] in x's dtype");
  TORCH_CHECK(!normed || norm->scalar_type() == x.scalar_type(), "linear_q: the norm's weight is in x's dtype");
  const at::Tensor rc = added ? residual->contiguous() : at::Tensor();
  // per-call buffers, kept by the calling thread: a decode step makes 121 calls
  static thread_local std::vector<int8_t> xq, xq4;
  static thread_local std::vector<float> sx, sxs, widened, prepared, norm_weight, accumulated;
  static thread_local std::vector<int32_t> xsum;
  xq.resize(M * K);
  sx.resize(M * (K / XB));
  sxs.resize(M * groups);
  xsum.resize(M * groups);
  widened.resize(bf16 ? Kin : 0);
  prepared.resize(normed || glu ? K : 0);
  if (normed) {                     // the norm's weight as floats, once a call
    const at::Tensor nc = norm->contiguous();
    norm_weight.resize(K);
    if (bf16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(nc.data_ptr<at::BFloat16>());
      if (isa == SCALAR) for (int64_t k = 0; k < K; ++k) norm_weight[k] = bf16_to_float(h[k]);
      else widen_bf16_avx2(h, norm_weight.data(), K);
    } else {
      std::memcpy(norm_weight.data(), nc.data_ptr<float>(), K * sizeof(float));
    }
  }
  accumulated.resize(bf16 ? M * N : 0);
  for (int64_t i = 0; i < M; ++i) {
    const float* xr;
    if (bf16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()) + i * Kin;
      if (isa == SCALAR) for (int64_t k = 0; k < Kin; ++k) widened[k] = bf16_to_float(h[k]);     // exact
      else widen_bf16_avx2(h, widened.data(), Kin);       // every other path runs on an AVX2 CPU
      xr = widened.data();
    } else {
      xr = xc.data_ptr<float>() + i * Kin;
    }
    if (normed) {
      (isa == SCALAR ? workbench_fused::rms_norm_row_scalar : workbench_fused::rms_norm_row_avx2)(xr, norm_weight.data(), K, static_cast<float>(eps), bf16, prepared.data());
      xr = prepared.data();
    } else if (glu) {
      (isa == SCALAR ? workbench_fused::silu_mul_row_scalar : workbench_fused::silu_mul_row_avx2)(
          xr, xr + K, K, bf16, prepared.data());
      xr = prepared.data();
    }
    (isa == AVX512 ? quantize_row_avx512 : isa == SCALAR ? quantize_row_scalar : quantize_row_avx2)(
        xr, K, group, xq.data() + i * K, sx.data() + i * (K / XB), sxs.data() + i * groups, xsum.data() + i * groups);
  }
  const bool by4 = isa == AVX2 || isa == AVX_VNNI || isa == AVX512VL_VNNI;
  xq4.resize(by4 ? (M + 3) / 4 * 4 * K : 0);
  if (by4) interleave4(xq.data(), M, K, xq4.data());
  const Rows rows{xq.data(), sx.data(), sxs.data(), xsum.data(), K, group, xq4.data()};
  at::Tensor out = at::empty({M, N}, x.options());
  float* yp = bf16 ? accumulated.data() : out.data_ptr<float>();
  const Weight base{wc.data_ptr<uint8_t>(), kq ? nullptr : sc.data_ptr(), w.size(1) * unit, kq ? 0 : groups * 2 * COLS};
  // the bias is added in fp32, then the sum is rounded once to bf16 (to nearest even); each
  // thread finishes its own columns as soon as its tiles are done (no second parallel region)
  const bool biased = bias.has_value() && bias->defined();
  const at::Tensor b = biased ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = biased ? b.data_ptr<float>() : nullptr;
  uint16_t* op = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* rb = added && bf16 ? reinterpret_cast<const uint16_t*>(rc.data_ptr<at::BFloat16>()) : nullptr;
  const float* rf = added && !bf16 ? rc.data_ptr<float>() : nullptr;
  if (M > 0) {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const bool half = sc.scalar_type() == at::kHalf;
      const Isa is = static_cast<Isa>(isa);
      if (fmt == KQ4) run_tiles<KQ4, float>(is, rows, M, t0, t1, base, yp, N);
      else if (fmt == KQ5) run_tiles<KQ5, float>(is, rows, M, t0, t1, base, yp, N);
      else if (fmt == KQ6) run_tiles<KQ6, float>(is, rows, M, t0, t1, base, yp, N);
      else if (bits == 4) {
        half ? run_tiles<4, at::Half>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N)
             : run_tiles<4, float>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N);
      } else if (bits == 5) {
        half ? run_tiles<5, at::Half>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N)
             : run_tiles<5, float>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N);
      } else {
        half ? run_tiles<8, at::Half>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N)
             : run_tiles<8, float>(static_cast<Isa>(isa), rows, M, t0, t1, base, yp, N);
      }
      if (!biased && !bf16 && !added) return;
      const int64_t n0 = t0 * COLS, n1 = t1 * COLS;
      for (int64_t i = 0; i < M; ++i) {
        if (bf16 && isa != SCALAR) {
          narrow_bf16_avx2(yp + i * N + n0, biased ? bp + n0 : nullptr, rb ? rb + i * N + n0 : nullptr,
                           op + i * N + n0, n1 - n0);
          continue;
        }
        for (int64_t n = n0; n < n1; ++n) {
          if (bf16) {
            op[i * N + n] = finish_bf16(yp[i * N + n], bp, rb ? rb + i * N : nullptr, n);
          } else {
            const float v = biased ? yp[i * N + n] + bp[n] : yp[i * N + n];
            yp[i * N + n] = rf ? rf[i * N + n] + v : v;       // fp32: y is the output already
          }
        }
      }
    });
  }
  return out;
}

// ---- weights named by index: what a compiled graph calls -----------------------------------
// A graph that read each weight's tensors would have dynamo check every one of them at every
// call (a tensor guard each, about 0.7 ms a decode step for the default model's 121 weights,
// even under the skipping stance, which keeps tensor guards). So a model's weights are
// registered here once (register_weights: a key), the step says whose weights it runs and on
// which instruction set (use_weights, once a step, per thread), and the graph names a weight
// by its index (linear_at). The graph holds no key: the same model gives the same graph in
// every process (inductor's disk cache).
struct Registered {
  at::Tensor w, scales;
  int64_t bits, group;
};
using Weights = std::shared_ptr<const std::vector<Registered>>;
std::mutex registry_lock;
std::unordered_map<int64_t, Weights> registry;
int64_t next_key = 0;
struct InUse {
  Weights weights;          // shared: another thread's forget leaves them valid until this one's next use
  int64_t key = -1, isa = 0;
};
thread_local InUse in_use;

int64_t register_weights(at::TensorList w, at::TensorList scales, at::IntArrayRef bits, at::IntArrayRef groups) {
  TORCH_CHECK(w.size() == scales.size() && w.size() == bits.size() && w.size() == groups.size(),
              "register_weights: one scale tensor, width and group per weight");
  auto entries = std::make_shared<std::vector<Registered>>();
  for (size_t i = 0; i < w.size(); ++i) {
    TORCH_CHECK(w[i].dim() == 3 && w[i].scalar_type() == at::kByte && w[i].is_contiguous() && scales[i].is_contiguous(),
                "register_weights: packed weights expected (cpu_quant.pack)");
    entries->push_back({w[i], scales[i], bits[i], groups[i]});
  }
  std::lock_guard<std::mutex> guard(registry_lock);
  registry[next_key] = std::move(entries);
  return next_key++;
}

void forget_weights(int64_t key) {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.erase(key);
  if (in_use.key == key) in_use = InUse{};
}

void use_weights(int64_t key, int64_t isa) {
  std::lock_guard<std::mutex> guard(registry_lock);
  auto found = registry.find(key);
  if (found == registry.end()) in_use = InUse{};
  TORCH_CHECK(found != registry.end(), "use_weights: no weights registered under ", key);
  in_use = InUse{found->second, key, isa};
}

at::Tensor linear_at(const at::Tensor& x, int64_t index, int64_t out_features, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& norm, double eps, bool glu,
                     const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(in_use.weights != nullptr, "linear_at: no model's weights in use on this thread (use_weights)");
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(in_use.weights->size()), "linear_at: no weight ", index);
  const Registered& r = (*in_use.weights)[index];
  TORCH_CHECK(r.w.size(0) * COLS == out_features, "linear_at: weight ", index, " has another width");
  return linear_q(x, r.w, r.scales, bias, r.bits, r.group, in_use.isa, norm, eps, glu, residual);
}

// Rows `ids` of a packed 4- or 8-bit weight as fp32, d * u + m computed in double and rounded
// once (cpu_quant.rows' torch expression, which this replaces for speed: an embedding looked up
// in its tied head's bytes, once a step; about 1 us where the torch ops took 66)
template <typename S>
void embed_rows_of(const uint8_t* w, const S* sc, int64_t bits, int64_t groups, int64_t group, int64_t nbytes,
                   const int64_t* ids, int64_t n, float* out) {
  const int64_t K = groups * group;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t tile = ids[r] / COLS, c = ids[r] % COLS;
    float* o = out + r * K;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + (tile * groups + g) * nbytes;
      const S* s = sc + (tile * groups + g) * 2 * COLS;
      const double d = static_cast<double>(scale_at<S>(s, c)), m = static_cast<double>(scale_at<S>(s + COLS, c));
      auto value = [&](unsigned u) { return static_cast<float>(static_cast<double>(u) * d + m); };
      float* og = o + g * group;
      for (int64_t j = 0; j < (bits == 8 ? group / 4 : 4); ++j)        // byte j*64 + c*4 + i
        for (int64_t i = 0; i < 4; ++i) {
          const uint8_t b = wg[j * 64 + c * 4 + i];
          if (bits != 8) {          // u[4j + i] in the low nibble, u[16 + 4j + i] in the high
            unsigned lo = b & 0x0F, hi = b >> 4;
            if (bits == 5) {        // bit 4: the plane of the low nibbles, then of the high ones
              const int at = static_cast<int>(c * 4 + i);
              lo |= ((wg[256 + j * 16 + (at >> 3)] >> (at & 7)) & 1u) << 4;
              hi |= ((wg[256 + j * 16 + 8 + (at >> 3)] >> (at & 7)) & 1u) << 4;
            }
            og[4 * j + i] = value(lo);
            og[16 + 4 * j + i] = value(hi);
          } else {
            og[4 * j + i] = value(b);
          }
        }
    }
  }
}

at::Tensor embed_rows(const at::Tensor& w, const at::Tensor& scales, int64_t bits, const at::Tensor& ids) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "embed_rows: a 4-, 5- or 8-bit packed weight");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte, "embed_rows: packed bytes [tiles, groups, bytes]");
  TORCH_CHECK(scales.is_contiguous() && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "embed_rows: fp16 or fp32 scales [tiles, groups, 2, 16]");
  const int64_t tiles = w.size(0), groups = w.size(1), nbytes = w.size(2), group = bits == 8 ? nbytes / COLS : 32;
  TORCH_CHECK(scales.numel() == tiles * groups * 2 * COLS, "embed_rows: scales of another shape");
  const at::Tensor idc = ids.to(at::kLong).contiguous().view(-1);
  const int64_t n = idc.numel();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < tiles * COLS, "embed_rows: id ", ip[r], " is outside the table's ", tiles * COLS, " rows");
  at::Tensor out = at::empty({n, groups * group}, w.options().dtype(at::kFloat));
  if (scales.scalar_type() == at::kHalf)
    embed_rows_of<at::Half>(w.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), bits, groups, group, nbytes, ip, n, out.data_ptr<float>());
  else
    embed_rows_of<float>(w.data_ptr<uint8_t>(), scales.data_ptr<float>(), bits, groups, group, nbytes, ip, n, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("linear_q(Tensor x, Tensor w, Tensor scales, Tensor? bias, int bits, int group, int isa, Tensor? norm=None, "
        "float eps=0., bool glu=False, Tensor? residual=None) -> Tensor");
  m.def("register_weights(Tensor[] w, Tensor[] scales, int[] bits, int[] groups) -> int");
  m.def("forget_weights(int key) -> ()");
  m.def("use_weights(int key, int isa) -> ()");
  m.def("embed_rows(Tensor w, Tensor scales, int bits, Tensor ids) -> Tensor");
  m.def("linear_at(Tensor x, int index, int out_features, Tensor? bias, Tensor? norm=None, float eps=0., "
        "bool glu=False, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_q", &linear_q);
  m.impl("linear_at", &linear_at);
  m.impl("embed_rows", &embed_rows);
}

TORCH_LIBRARY_IMPL(workbench_cpu, CatchAll, m) {
  m.impl("register_weights", &register_weights);
  m.impl("forget_weights", &forget_weights);
  m.impl("use_weights", &use_weights);
}
