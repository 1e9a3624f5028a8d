// Paged attention on the CPU: the compiled step's attention op (engine/kernels/cpu_attention.py).
//
// Every query row attends over the keys its pass metadata lists for it: the first
// `prefix[r]` cache indices of its sequence (a causal row: its position + 1), then the
// cache indices extra_keys[extra_start[r] .. extra_start[r+1]) (a draft tree row: its path).
// A cache index i lives in slot tables[seq][i / BS] * BS + i % BS of the pool.
//
// Batch-invariant by construction: one (row, KV head) is one task, run by one thread, over
// its keys in order. Scores are fp32 dot products over D in 8-lane vectors summed in a fixed
// order, softmax takes two passes (max, then exp and sums in key order), and nothing depends
// on the other rows of the pass, the thread count or the instruction set: the vectors are
// GCC's generic vectors, compiled once for AVX2 and once for the baseline, with the same
// lane-wise IEEE arithmetic (-ffp-contract=off: no fused multiply-adds), so both give the
// same bits. K/V are read as stored: fp32, bf16 (widened exactly) or FP8 e4m3 through a
// 256-entry table times the per-(token, head) fp32 scale, the cache's own dequantization.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "cpu_bf16.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float f8 __attribute__((vector_size(32)));

enum Kind : int64_t { KIND_F32 = 0, KIND_BF16 = 1, KIND_FP8 = 2 };

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {            // e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits
      int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
      float v;
      if (exp == 15 && man == 7) v = std::numeric_limits<float>::quiet_NaN();
      else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);          // subnormal: man/8 * 2^-6
      else v = std::ldexp(1.0f + man / 8.0f, exp - 7);
      value[b] = sign ? -v : v;
    }
  }
};
const Fp8Table FP8;

struct Pass {
  const void* q; const void* k; const void* v; const float* ks; const float* vs;
  void* out; const int64_t* tables; int64_t table_width;
  const int64_t* row_seq; const int64_t* prefix; const int64_t* extra_start; const int64_t* extra_keys;
  int64_t hq, hkv, d, bs; float scale; int64_t q_bf16, kind;
};

// One head's D values of a pool slot as fp32 (D a multiple of 8).
static inline __attribute__((always_inline)) void load_kv(const Pass& p, const void* pool, const float* scales,
                                                           int64_t slot, int64_t h, float* dst) {
  int64_t at = (slot * p.hkv + h) * p.d;
  if (p.kind == KIND_F32) {
    std::memcpy(dst, static_cast<const float*>(pool) + at, p.d * 4);
  } else if (p.kind == KIND_BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(pool) + at;
    for (int64_t i = 0; i < p.d; ++i) dst[i] = workbench_bf16::bf16_to_float(src[i]);
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(pool) + at;
    float s = scales[slot * p.hkv + h];
    for (int64_t i = 0; i < p.d; ++i) dst[i] = FP8.value[src[i]] * s;
  }
}

static inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t d) {
  f8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < d; i += 8) {
    f8 x, y;
    std::memcpy(&x, a + i, 32);
    std::memcpy(&y, b + i, 32);
    acc += x * y;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline __attribute__((always_inline)) void task(const Pass& p, int64_t r, int64_t h,
                                                        std::vector<float>& buf) {
  const int64_t g_size = p.hq / p.hkv, d = p.d;
  const int64_t seq = p.row_seq[r], prefix = p.prefix[r];
  const int64_t e0 = p.extra_start[r], keys = prefix + p.extra_start[r + 1] - e0;
  const int64_t* table = p.tables + seq * p.table_width;
  buf.resize(static_cast<size_t>(g_size * (d + keys + d) + d));
  float* q = buf.data();                       // [G, D]
  float* scores = q + g_size * d;              // [G, keys]
  float* acc = scores + g_size * keys;         // [G, D]
  float* row = acc + g_size * d;               // [D]: one key or value as fp32
  for (int64_t g = 0; g < g_size; ++g) {
    int64_t at = (r * p.hq + h * g_size + g) * d;
    for (int64_t i = 0; i < d; ++i)
      q[g * d + i] = p.q_bf16 ? workbench_bf16::bf16_to_float(static_cast<const uint16_t*>(p.q)[at + i])
                              : static_cast<const float*>(p.q)[at + i];
  }
  auto slot_of = [&](int64_t t) {
    int64_t index = t < prefix ? t : p.extra_keys[e0 + t - prefix];
    return table[index / p.bs] * p.bs + index % p.bs;
  };
  for (int64_t t = 0; t < keys; ++t) {
    load_kv(p, p.k, p.ks, slot_of(t), h, row);
    for (int64_t g = 0; g < g_size; ++g) scores[g * keys + t] = dot(q + g * d, row, d) * p.scale;
  }
  for (int64_t g = 0; g < g_size; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < keys; ++t) m = scores[g * keys + t] > m ? scores[g * keys + t] : m;
    for (int64_t t = 0; t < keys; ++t) scores[g * keys + t] = std::exp(scores[g * keys + t] - m);
  }
  std::memset(acc, 0, g_size * d * 4);
  float total[64] = {0};                       // G <= 64 query heads per KV head
  for (int64_t t = 0; t < keys; ++t) {
    load_kv(p, p.v, p.vs, slot_of(t), h, row);
    for (int64_t g = 0; g < g_size; ++g) {
      float w = scores[g * keys + t];
      total[g] += w;
      f8 wv = {w, w, w, w, w, w, w, w};
      for (int64_t i = 0; i < d; i += 8) {
        f8 a, x;
        std::memcpy(&a, acc + g * d + i, 32);
        std::memcpy(&x, row + i, 32);
        a += wv * x;
        std::memcpy(acc + g * d + i, &a, 32);
      }
    }
  }
  for (int64_t g = 0; g < g_size; ++g) {
    int64_t at = (r * p.hq + h * g_size + g) * d;
    for (int64_t i = 0; i < d; ++i) {
      float o = acc[g * d + i] / total[g];
      if (p.q_bf16) static_cast<uint16_t*>(p.out)[at + i] = workbench_bf16::float_to_bf16(o);
      else static_cast<float*>(p.out)[at + i] = o;
    }
  }
}

static void run_range(const Pass& p, int64_t begin, int64_t end) {
  thread_local std::vector<float> buf;
  for (int64_t i = begin; i < end; ++i) task(p, i / p.hkv, i % p.hkv, buf);
}

__attribute__((target("avx2,fma"))) static void run_range_avx2(const Pass& p, int64_t begin, int64_t end) {
  thread_local std::vector<float> buf;
  for (int64_t i = begin; i < end; ++i) task(p, i / p.hkv, i % p.hkv, buf);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& prefix,
                           const at::Tensor& extra_start, const at::Tensor& extra_keys, double scale,
                           int64_t kind, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [N, H_q, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be fp32 or bf16");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous(), "pools must be contiguous [blocks, BS, H_kv, D]");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(2);
  TORCH_CHECK(d % 8 == 0 && hq % hkv == 0 && hq / hkv <= 64, "head_dim must be a multiple of 8, G <= 64");
  TORCH_CHECK(kind != KIND_FP8 || (k_scale.has_value() && v_scale.has_value()), "an FP8 pool needs its scales");
  auto out = at::empty_like(q);
  Pass p{q.data_ptr(), k.data_ptr(), v.data_ptr(),
         kind == KIND_FP8 ? k_scale->data_ptr<float>() : nullptr,
         kind == KIND_FP8 ? v_scale->data_ptr<float>() : nullptr,
         out.data_ptr(), tables.data_ptr<int64_t>(), tables.size(1),
         row_seq.data_ptr<int64_t>(), prefix.data_ptr<int64_t>(), extra_start.data_ptr<int64_t>(),
         extra_keys.data_ptr<int64_t>(), hq, hkv, d, k.size(1), static_cast<float>(scale),
         q.scalar_type() == at::kBFloat16, kind};
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    if (isa >= 1) run_range_avx2(p, begin, end);
    else run_range(p, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor? k_scale, Tensor? v_scale, Tensor tables, "
        "Tensor row_seq, Tensor prefix, Tensor extra_start, Tensor extra_keys, float scale, int kind, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
