// Paged attention on the CPU: the compiled step's attention op (engine/kernels/cpu_attention.py).
//
// Every query row attends over the keys its pass metadata lists for it: the first
// `prefix[r]` cache indices of its sequence (a causal row: its position + 1), then the
// cache indices extra_keys[extra_start[r] .. extra_start[r+1]) (a draft tree row: its path).
// A cache index i lives in slot tables[seq][i / BS] * BS + i % BS of the pool.
//
// A row's keys, in that order, hold positions 0, 1, ..: the causal prefix, then a tree row's
// path by depth (its chain's positions), so the row itself sits at the last. A sliding window
// of W (0: none) sees the last W of them: the key loop starts there. Attention sinks (gpt-oss:
// one logit per query head) add exp(sink - m) to the softmax's denominator, m the max over
// the row's scores and its sink, after the keys' terms.
//
// Batch-invariant by construction: a (row, KV head) is computed by one thread over its keys in
// order; the rows of one sequence that a task attends together (a verify pass's k + 1 rows)
// share each key's and value's read, never a sum (task). Scores are fp32 dot products over D in 8-lane vectors summed in a fixed
// order, softmax takes two passes (max, then exp and sums in key order; exp is our own
// vector polynomial, Cephes' expf, the same in every build), and nothing depends
// on the other rows of the pass, the thread count or the instruction set: the vectors are
// GCC's generic vectors, compiled once for AVX2 and once for the baseline, with the same
// lane-wise IEEE arithmetic (-ffp-contract=off: no fused multiply-adds), so both give the
// same bits. K/V are read as stored: fp32, bf16 (widened exactly) or FP8 e4m3 through a
// 256-entry table times the per-(token, head) fp32 scale, the cache's own dequantization.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include "cpu_bf16.h"
#include "cpu_fused.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) f8 splat(float x) { return f8{x, x, x, x, x, x, x, x}; }
// splat(x) for an x that is not -0 (x + 0 is x but for -0) in one broadcast: GCC builds splat's
// vector of a runtime x from 8 inserts, a scalar added to a vector from vbroadcastss.
static inline __attribute__((always_inline)) f8 broadcast(float x) { return f8{} + x; }
static inline __attribute__((always_inline)) f8 select(i8v mask, f8 yes, f8 no) {
  return (f8)(((i8v)yes & mask) | ((i8v)no & ~mask));
}

// e^x for 8 lanes: Cephes' expf (x = n ln 2 + r, a degree-5 polynomial in r, 2^n from the
// exponent bits), about 1 ulp; x is clamped to [-87.3, 88.4] (e^-87.3 stands in for 0).
static inline __attribute__((always_inline)) f8 exp8(f8 x) {
  x = select(x < splat(-87.3365478515625f), splat(-87.3365478515625f), x);
  x = select(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
  f8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  f8 fl = __builtin_convertvector(__builtin_convertvector(fx, i8v), f8);      // truncated toward 0
  fl = select(fl > fx, fl - splat(1.0f), fl);                                 // floor
  x = x - fl * splat(0.693359375f);
  x = x - fl * splat(-2.12194440e-4f);
  f8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * (x * x) + x + splat(1.0f);
  i8v n = __builtin_convertvector(fl, i8v);
  return y * (f8)((n + 127) << 23);
}

enum Kind : int64_t { KIND_F32 = 0, KIND_BF16 = 1, KIND_FP8 = 2 };

struct Pass {
  const void* q; const void* k; const void* v; const float* ks; const float* vs;
  void* out; const int64_t* tables; int64_t table_width;
  const int64_t* row_seq; const int64_t* prefix; const int64_t* extra_start; const int64_t* extra_keys;
  int64_t hq, hkv, d, bs; float scale; int64_t window; const float* sinks; int64_t q_bf16, kind;
};

// One head's D values of a pool slot as fp32 (D a multiple of 8). bf16 widens exactly (a
// 16-bit shift); e4m3 goes exactly to fp32 by moving its exponent and mantissa into place
// and scaling by 2^120 (which also gets its subnormals right; 0x7f/0xff are NaN), then one
// fp32 multiply by the (token, head) scale: the torch expression's bits.
template <int64_t KIND>
static inline __attribute__((always_inline)) void load_kv(const Pass& p, const void* pool, const float* scales,
                                                           int64_t slot, int64_t h, float* dst) {
  int64_t at = (slot * p.hkv + h) * p.d;
  if (KIND == KIND_F32) {
    std::memcpy(dst, static_cast<const float*>(pool) + at, p.d * 4);
  } else if (KIND == KIND_BF16 && p.d % 16 == 0) {
    // 16 values at a time as 8 lanes of 2: the low halves, then the high ones (order 2j + k).
    const uint16_t* src = static_cast<const uint16_t*>(pool) + at;
    for (int64_t c = 0; c < p.d; c += 16) {
      u8v w;
      std::memcpy(&w, src + c, 32);
      f8 low = (f8)(w << 16), high = (f8)(w & 0xffff0000u);
      std::memcpy(dst + c, &low, 32);
      std::memcpy(dst + c + 8, &high, 32);
    }
  } else if (KIND == KIND_BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(pool) + at;
    for (int64_t i = 0; i < p.d; ++i) dst[i] = workbench_bf16::bf16_to_float(src[i]);
  } else if (p.d % 32 == 0) {
    // 32 bytes at a time as 8 lanes of 4: byte k of every lane, decoded in place, is one
    // vector, so a chunk comes out in the order 4j + k (lane_order; q and the output match it).
    const uint8_t* src = static_cast<const uint8_t*>(pool) + at;
    const f8 s = broadcast(scales[slot * p.hkv + h]);      // a scale: > 0
    const i8v mag_mask = i8v{0} + (0x7f << 20), sign_mask = i8v{0} + static_cast<int32_t>(0x80000000u);
    const i8v nan_bits = i8v{0} + 0x7fc00000;
    for (int64_t c = 0; c < p.d; c += 32) {
      u8v w;
      std::memcpy(&w, src + c, 32);
      for (int k = 0; k < 4; ++k) {
        i8v mag_bits = (i8v)(k < 3 ? w << (20 - 8 * k) : w >> 4) & mag_mask;
        i8v sign = (i8v)(w << (24 - 8 * k)) & sign_mask;
        f8 mag = (f8)mag_bits * splat(0x1p120f);
        mag = select(mag_bits == mag_mask, (f8)nan_bits, mag);
        f8 x = (f8)((i8v)mag | sign) * s;
        std::memcpy(dst + c + 8 * k, &x, 32);
      }
    }
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(pool) + at;
    const float s = scales[slot * p.hkv + h];
    for (int64_t i = 0; i < p.d; ++i) {
      uint32_t b = src[i], mag_bits = (b & 0x7f) << 20;
      float mag;
      std::memcpy(&mag, &mag_bits, 4);
      mag = mag_bits == (0x7fu << 20) ? std::numeric_limits<float>::quiet_NaN() : mag * 0x1p120f;
      uint32_t bits;
      std::memcpy(&bits, &mag, 4);
      bits |= (b & 0x80) << 24;
      std::memcpy(&mag, &bits, 4);
      dst[i] = mag * s;
    }
  }
}

// One head's D values of a pool slot as fp32, where they can be read: an fp32 pool's own
// (nothing copied: a copy's wide stores, read back in halves, stalled the loads after them),
// else decoded into `scratch` (load_kv).
template <int64_t KIND>
static inline __attribute__((always_inline)) const float* kv_row(const Pass& p, const void* pool, const float* scales,
                                                                 int64_t slot, int64_t h, float* scratch) {
  if (KIND == KIND_F32) return static_cast<const float*>(pool) + (slot * p.hkv + h) * p.d;
  load_kv<KIND>(p, pool, scales, slot, h, scratch);
  return scratch;
}

// Where element i of a head's D values sits once a key or value is decoded (and so where q
// is put and the output read): FP8 in chunks of 32 in the order 4j + k, bf16 in chunks of
// 16 in the order 2j + k (see load_kv); fp32 in place.
template <int64_t KIND>
static inline __attribute__((always_inline)) int64_t lane_order(int64_t i, int64_t d) {
  const int64_t per = KIND == KIND_FP8 ? 4 : KIND == KIND_BF16 ? 2 : 1;
  if (per == 1 || d % (8 * per) != 0) return i;
  int64_t c = i / (8 * per) * (8 * per), e = i % (8 * per);
  return c + (e % per) * 8 + e / per;
}

// The cache lines of one head's values of a slot, fetched ahead of their use.
template <int64_t KIND>
static inline __attribute__((always_inline)) void prefetch(const Pass& p, const void* pool, int64_t slot, int64_t h) {
  const int64_t bytes = p.d * (KIND == KIND_F32 ? 4 : KIND == KIND_BF16 ? 2 : 1);
  const char* at = static_cast<const char*>(pool) + (slot * p.hkv + h) * bytes;
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(at + i);
}

constexpr int64_t KT = 8;     // keys whose scores are computed together (independent sums)

// One row's keys as the task sees them: its cache indices first .. all - 1 in its key order
// (the causal prefix, then a tree row's path), scores at `scores` [G, stride].
struct RowKeys {
  int64_t prefix, e0, all, first, keys, stride;
  float* scores;
};

// The cache index of key t of a row (t < all).
static inline __attribute__((always_inline)) int64_t key_index(const Pass& p, const RowKeys& k, int64_t t) {
  return t < k.prefix ? t : p.extra_keys[k.e0 + t - k.prefix];
}

// [a0 + a1, a2 + a3, b0 + b1, b2 + b3, a4 + a5, a6 + a7, b4 + b5, b6 + b7]: vhaddps's pairwise sums.
static inline __attribute__((always_inline)) f8 hadd(f8 a, f8 b) {
  const i8v even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// The horizontal sums of 8 vectors side by side, lane j: ((a0 + a1) + (a2 + a3)) + ((a4 + a5) +
// (a6 + a7)) of a = s[j], all 8 taken together through 7 vector adds, not 7 scalar adds each.
static inline __attribute__((always_inline)) f8 hsum8(const f8* s) {
  const f8 h0 = hadd(hadd(s[0], s[1]), hadd(s[2], s[3]));   // lane j < 4: s[j]'s low half's sum, j + 4: its high half's
  const f8 h1 = hadd(hadd(s[4], s[5]), hadd(s[6], s[7]));
  const i8v low = {0, 1, 2, 3, 8, 9, 10, 11}, high = {4, 5, 6, 7, 12, 13, 14, 15};
  return __builtin_shuffle(h0, h1, low) + __builtin_shuffle(h0, h1, high);
}

// Scores of KT keys (rows of D fp32 values; a missing key points at zeros) for query head g
// of a row, lane j key j's: each key's dot product its own chain of 8-lane sums over D, then a
// fixed horizontal sum (hsum8's order; KT keys side by side only so that the chains run
// together). DC: D where it is known when compiled (else 0: d).
template <int64_t DC>
static inline __attribute__((always_inline)) f8 tile_scores(const float* qg, const float* const* keys, int64_t d_,
                                                            float scale) {
  static_assert(KT == 8, "hsum8 sums 8 keys");
  const int64_t d = DC ? DC : d_;
  // Loaded here, not kept from the last call: GCC otherwise hoists a tile's KT x D keys out of
  // the loops over rows and heads, more than the registers hold, and spills them to the stack.
  asm volatile("" ::: "memory");
  f8 sum[KT];
  for (int64_t j = 0; j < KT; ++j) sum[j] = splat(0.0f);
  for (int64_t i = 0; i < d; i += 8) {
    f8 x;
    std::memcpy(&x, qg + i, 32);
    for (int64_t j = 0; j < KT; ++j) {
      f8 y;
      std::memcpy(&y, keys[j] + i, 32);
      sum[j] += x * y;
    }
  }
  return hsum8(sum) * broadcast(scale);
}

// A tile's scores (keys t0 .. t0 + n - 1 of a row's order, lane i key t0 + i) into the row's
// score row `sg` (whose first is key `first`): the keys at or after `first` only. Whole when
// they fit (lanes past n write padding, or a row's own keys' places, written after).
static inline __attribute__((always_inline)) void put_scores(float* sg, int64_t stride, int64_t first, int64_t t0,
                                                             int64_t n, f8 s) {
  if (t0 >= first && t0 - first + KT <= stride) {
    std::memcpy(sg + t0 - first, &s, 32);
  } else {
    for (int64_t i = 0; i < n; ++i)
      if (t0 + i >= first) sg[t0 + i - first] = s[i];
  }
}

constexpr int64_t VC = 8;     // 8-lane vectors of D a value pass keeps in registers

// acc[G, D] += w[g, t] * values[t] for n consecutive keys of a row (their weights at
// scores[g * stride + at + t]), each lane summed in key order (each key's term added to the
// lane in turn, as one key at a time would), the accumulators held in registers over the keys;
// and each weight into total[g], in key order.
template <int64_t DC>
static inline __attribute__((always_inline)) void add_values(float* acc, float* total, const float* scores,
                                                             int64_t stride, int64_t at, const float* const* values,
                                                             int64_t n, int64_t g_size, int64_t d_) {
  const int64_t d = DC ? DC : d_;
  for (int64_t g = 0; g < g_size; ++g) {
    const float* w = scores + g * stride + at;
    float sum = total[g];                           // in a register: total and w share the buffer
    for (int64_t t = 0; t < n; ++t) sum += w[t];
    total[g] = sum;
    for (int64_t c = 0; c < d; c += 8 * VC) {
      const int64_t nv = (d - c) / 8 < VC ? (d - c) / 8 : VC;
      float* a_at = acc + g * d + c;
      f8 a[VC];
#pragma GCC unroll 8
      for (int64_t i = 0; i < VC; ++i)     // unrolled: else GCC copies a[] through the stack
        if (i < nv) std::memcpy(&a[i], a_at + 8 * i, 32);
      for (int64_t t = 0; t < n; ++t) {
        const f8 wv = broadcast(w[t]);      // a softmax weight: >= 0
        for (int64_t i = 0; i < VC; ++i)
          if (i < nv) {
            f8 x;
            std::memcpy(&x, values[t] + c + 8 * i, 32);
            a[i] += wv * x;
          }
      }
#pragma GCC unroll 8
      for (int64_t i = 0; i < VC; ++i)
        if (i < nv) std::memcpy(a_at + 8 * i, &a[i], 32);
    }
  }
}

// Rows r0 .. r1 - 1 of one sequence (consecutive in the pass) at KV head h: a verify pass's
// k + 1 rows, a prefill chunk's rows. The keys the rows share (cache indices below the least
// prefix) are read once, for every row that sees them; each row's own keys after. A row's
// arithmetic is exactly what it is alone: each score its own chain, the softmax over its keys
// in order, its values summed in its key order (the shared keys come first in every row's
// order), so which rows share a task changes no bit.
template <int64_t KIND, int64_t DC>
static inline __attribute__((always_inline)) void task(const Pass& p, int64_t r0, int64_t r1, int64_t h,
                                                        std::vector<float>& buf, std::vector<int64_t>& slots,
                                                        std::vector<RowKeys>& rows) {
  const int64_t g_size = p.hq / p.hkv, d = DC ? DC : p.d, n_rows = r1 - r0;
  const int64_t* table = p.tables + p.row_seq[r0] * p.table_width;
  rows.resize(static_cast<size_t>(n_rows));
  int64_t shared_end = std::numeric_limits<int64_t>::max(), lo = shared_end, score_floats = 0;
  for (int64_t j = 0; j < n_rows; ++j) {
    const int64_t r = r0 + j;
    RowKeys& k = rows[j];
    k.prefix = p.prefix[r];
    k.e0 = p.extra_start[r];
    k.all = k.prefix + p.extra_start[r + 1] - k.e0;
    k.first = p.window > 0 && k.all > p.window ? k.all - p.window : 0;     // the window's first key
    k.keys = k.all - k.first;
    k.stride = (k.keys + KT - 1) / KT * KT;         // a score row, padded to whole key tiles
    score_floats += g_size * k.stride;
    shared_end = k.prefix < shared_end ? k.prefix : shared_end;
    lo = k.first < lo ? k.first : lo;
  }
  if (lo > shared_end) lo = shared_end;             // every window starts after the shared keys: none shared
  buf.resize(static_cast<size_t>(2 * n_rows * g_size * d + score_floats + (KT + 1) * d + 2 * n_rows * g_size));
  float* q = buf.data();                            // [R, G, D]
  float* acc = q + n_rows * g_size * d;             // [R, G, D]
  float* tile = acc + n_rows * g_size * d;          // [KT, D]: decoded keys or values (not an fp32 pool's)
  float* zeros = tile + KT * d;                     // [D]: the missing keys of a tile
  float* total = zeros + d;                         // [R, G]
  float* sink_term = total + n_rows * g_size;       // [R, G]
  float* scores = sink_term + n_rows * g_size;
  for (int64_t j = 0; j < n_rows; ++j) {
    rows[j].scores = scores;
    std::memset(scores, 0, rows[j].stride * g_size * 4);    // the padding lanes: computed, never summed
    scores += g_size * rows[j].stride;
    for (int64_t g = 0; g < g_size; ++g) {
      int64_t at = ((r0 + j) * p.hq + h * g_size + g) * d;
      for (int64_t i = 0; i < d; ++i)
        q[(j * g_size + g) * d + lane_order<KIND>(i, d)] =
            p.q_bf16 ? workbench_bf16::bf16_to_float(static_cast<const uint16_t*>(p.q)[at + i])
                     : static_cast<const float*>(p.q)[at + i];
    }
  }
  // the shared keys' slots (cache indices lo .. shared_end - 1: every row's causal prefix)
  slots.resize(static_cast<size_t>(shared_end - lo));
  for (int64_t t = lo; t < shared_end; ++t) slots[t - lo] = table[t / p.bs] * p.bs + t % p.bs;
  std::memset(zeros, 0, d * 4);
  const float* kv[KT];                              // the tile's keys (or values), fp32
  for (int64_t t0 = lo; t0 < shared_end; t0 += KT) {
    const int64_t n = shared_end - t0 < KT ? shared_end - t0 : KT;
    for (int64_t t = t0 + KT; t < t0 + 2 * KT && t < shared_end; ++t) prefetch<KIND>(p, p.k, slots[t - lo], h);
    for (int64_t j = 0; j < n; ++j) kv[j] = kv_row<KIND>(p, p.k, p.ks, slots[t0 - lo + j], h, tile + j * d);
    for (int64_t j = n; j < KT; ++j) kv[j] = zeros;
    for (int64_t j = 0; j < n_rows; ++j) {
      const RowKeys& k = rows[j];
      if (t0 + n <= k.first) continue;              // all before this row's window
      for (int64_t g = 0; g < g_size; ++g)
        put_scores(k.scores + g * k.stride, k.stride, k.first, t0, n,
                   tile_scores<DC>(q + (j * g_size + g) * d, kv, d, p.scale));
    }
  }
  for (int64_t j = 0; j < n_rows; ++j) {            // each row's own keys
    const RowKeys& k = rows[j];
    const int64_t own = k.first > shared_end ? k.first : shared_end;
    for (int64_t t0 = own; t0 < k.all; t0 += KT) {
      const int64_t n = k.all - t0 < KT ? k.all - t0 : KT;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t index = key_index(p, k, t0 + i);
        kv[i] = kv_row<KIND>(p, p.k, p.ks, table[index / p.bs] * p.bs + index % p.bs, h, tile + i * d);
      }
      for (int64_t i = n; i < KT; ++i) kv[i] = zeros;
      for (int64_t g = 0; g < g_size; ++g)
        put_scores(k.scores + g * k.stride, k.stride, k.first, t0, n,
                   tile_scores<DC>(q + (j * g_size + g) * d, kv, d, p.scale));
    }
  }
  for (int64_t j = 0; j < n_rows; ++j) {            // each row's softmax numerators
    const RowKeys& k = rows[j];
    for (int64_t g = 0; g < g_size; ++g) {
      float* sg = k.scores + g * k.stride;
      // the max, 8 lanes at a time, then the rest (a max is the same in any order; the
      // padding lanes are not scores)
      f8 mv = splat(-std::numeric_limits<float>::infinity());
      int64_t t = 0;
      for (; t + 8 <= k.keys; t += 8) {
        f8 x;
        std::memcpy(&x, sg + t, 32);
        mv = select(x > mv, x, mv);
      }
      float m = mv[0];
      for (int i = 1; i < 8; ++i) m = mv[i] > m ? mv[i] : m;
      for (; t < k.keys; ++t) m = sg[t] > m ? sg[t] : m;
      sink_term[j * g_size + g] = 0.0f;
      if (p.sinks) {
        const float sink = p.sinks[h * g_size + g];
        m = sink > m ? sink : m;
        sink_term[j * g_size + g] = exp8(splat(sink - m))[0];
      }
      for (int64_t t = 0; t < k.stride; t += 8) {
        f8 x;
        std::memcpy(&x, sg + t, 32);
        x = exp8(x - splat(m));
        std::memcpy(sg + t, &x, 32);
      }
    }
  }
  std::memset(acc, 0, n_rows * g_size * d * 4);
  std::memset(total, 0, n_rows * g_size * 4);
  for (int64_t t0 = lo; t0 < shared_end; t0 += KT) {      // the shared values, each read once
    const int64_t n = shared_end - t0 < KT ? shared_end - t0 : KT;
    for (int64_t t = t0 + KT; t < t0 + 2 * KT && t < shared_end; ++t) prefetch<KIND>(p, p.v, slots[t - lo], h);
    for (int64_t i = 0; i < n; ++i) kv[i] = kv_row<KIND>(p, p.v, p.vs, slots[t0 - lo + i], h, tile + i * d);
    for (int64_t j = 0; j < n_rows; ++j) {
      const RowKeys& k = rows[j];
      const int64_t from = k.first > t0 ? k.first : t0;      // the row's window's keys of the tile
      if (from < t0 + n)
        add_values<DC>(acc + j * g_size * d, total + j * g_size, k.scores, k.stride, from - k.first, kv + (from - t0),
                   t0 + n - from, g_size, d);
    }
  }
  for (int64_t j = 0; j < n_rows; ++j) {            // then each row's own, in its key order
    const RowKeys& k = rows[j];
    const int64_t own = k.first > shared_end ? k.first : shared_end;
    for (int64_t t0 = own; t0 < k.all; t0 += KT) {
      const int64_t n = k.all - t0 < KT ? k.all - t0 : KT;
      for (int64_t t = t0 + KT; t < t0 + 2 * KT && t < k.all; ++t) {
        const int64_t ahead = key_index(p, k, t);
        prefetch<KIND>(p, p.v, table[ahead / p.bs] * p.bs + ahead % p.bs, h);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t index = key_index(p, k, t0 + i);
        kv[i] = kv_row<KIND>(p, p.v, p.vs, table[index / p.bs] * p.bs + index % p.bs, h, tile + i * d);
      }
      add_values<DC>(acc + j * g_size * d, total + j * g_size, k.scores, k.stride, t0 - k.first, kv, n, g_size, d);
    }
  }
  for (int64_t j = 0; j < n_rows; ++j)
    for (int64_t g = 0; g < g_size; ++g) {
      const float sum = total[j * g_size + g] + (p.sinks ? sink_term[j * g_size + g] : 0.0f);
      int64_t at = ((r0 + j) * p.hq + h * g_size + g) * d;
      for (int64_t i = 0; i < d; ++i) {
        float o = acc[(j * g_size + g) * d + lane_order<KIND>(i, d)] / sum;
        if (p.q_bf16) static_cast<uint16_t*>(p.out)[at + i] = workbench_bf16::float_to_bf16(o);
        else static_cast<float*>(p.out)[at + i] = o;
      }
    }
}

// A task for the pool's kind, D compiled in where it is 64 or 128 (DC; 0: any D).
template <int64_t DC>
static inline __attribute__((always_inline)) void task_of(const Pass& p, int64_t r0, int64_t r1, int64_t h,
                                                           std::vector<float>& buf, std::vector<int64_t>& slots,
                                                           std::vector<RowKeys>& rows) {
  if (p.kind == KIND_F32) task<KIND_F32, DC>(p, r0, r1, h, buf, slots, rows);
  else if (p.kind == KIND_BF16) task<KIND_BF16, DC>(p, r0, r1, h, buf, slots, rows);
  else task<KIND_FP8, DC>(p, r0, r1, h, buf, slots, rows);
}

// Task i is KV head i / n_groups over group i % n_groups (rows groups[g] .. groups[g + 1] - 1):
// a thread's contiguous share of tasks mixes the groups, which differ in size (a verify of 4
// drafts: groups of 2 and 3 rows, 7 and 8 rows a thread, where group-major order gave 6 and 9),
// and a head's groups run one after the other over its keys, still in cache.
static inline __attribute__((always_inline)) void run_tasks(const Pass& p, const int64_t* groups, int64_t n_groups,
                                                            int64_t begin, int64_t end) {
  thread_local std::vector<float> buf;
  thread_local std::vector<int64_t> slots;
  thread_local std::vector<RowKeys> rows;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t g = i % n_groups, r0 = groups[g], r1 = groups[g + 1], h = i / n_groups;
    if (p.d == 64) task_of<64>(p, r0, r1, h, buf, slots, rows);
    else if (p.d == 128) task_of<128>(p, r0, r1, h, buf, slots, rows);
    else task_of<0>(p, r0, r1, h, buf, slots, rows);
  }
}

static void run_range(const Pass& p, const int64_t* groups, int64_t n_groups, int64_t begin, int64_t end) {
  run_tasks(p, groups, n_groups, begin, end);
}

__attribute__((target("avx2,fma"))) static void run_range_avx2(const Pass& p, const int64_t* groups, int64_t n_groups,
                                                               int64_t begin, int64_t end) {
  run_tasks(p, groups, n_groups, begin, end);
}

constexpr int64_t GROUP_ROWS = 16;                 // rows of one sequence a task attends together, at most...
constexpr int64_t GROUP_SCORE_BYTES = 1 << 20;     // ...whose scores fit this (they are written, then read twice)

// The pass's first n rows cut into groups of consecutive rows of one sequence (group g: rows
// groups[g] .. groups[g + 1] - 1), each sequence's rows in groups of equal size as large as
// GROUP_ROWS and GROUP_SCORE_BYTES allow, smaller until there are two tasks a thread (or one
// row a group). Any grouping gives the same bits (see task); this one only spreads the work.
std::vector<int64_t> row_groups(const Pass& p, int64_t n) {
  const int64_t g_size = p.hq / p.hkv, threads = at::get_num_threads();
  // runs of consecutive rows of one sequence
  std::vector<int64_t> runs{0};
  for (int64_t r = 1; r < n; ++r)
    if (p.row_seq[r] != p.row_seq[r - 1]) runs.push_back(r);
  runs.push_back(n);
  for (int64_t most = GROUP_ROWS;; most = (most + 1) / 2) {
    std::vector<int64_t> groups{0};
    for (size_t i = 0; i + 1 < runs.size(); ++i) {
      const int64_t a = runs[i], b = runs[i + 1];
      int64_t keys = 1;                 // the longest row's scores bound the rows a group may take
      for (int64_t r = a; r < b; ++r) {
        const int64_t all = p.prefix[r] + p.extra_start[r + 1] - p.extra_start[r];
        keys = std::max(keys, p.window > 0 && all > p.window ? p.window : all);
      }
      const int64_t row_bytes = g_size * ((keys + KT - 1) / KT * KT) * 4;
      const int64_t per = std::min(most, std::max<int64_t>(1, GROUP_SCORE_BYTES / row_bytes));
      const int64_t parts = (b - a + per - 1) / per;            // groups of the run, as equal as can be
      for (int64_t k = 1; k <= parts; ++k) groups.push_back(a + (b - a) * k / parts);
    }
    if (most == 1 || static_cast<int64_t>(groups.size() - 1) * p.hkv >= 2 * threads) return groups;
  }
}

// The pass's rows as the kernel reads them (cpu_attention.PassRows), and n, the rows attended
struct RowsIn {
  const at::Tensor &tables, &row_seq, &prefix, &extra_start, &extra_keys;
};

void check_rows(const RowsIn& rows) {
  for (const at::Tensor* t : {&rows.tables, &rows.row_seq, &rows.prefix, &rows.extra_start, &rows.extra_keys})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "the pass's rows must be contiguous int64");
}

// out[:n] = each of q's first n rows over its keys; pools k, v of one layer ([blocks, BS, H_kv,
// D] at k_data / v_data, FP8 scales [blocks, BS, H_kv] at ks / vs)
void attend(const at::Tensor& q, int64_t n, const void* k_data, const void* v_data, const float* ks, const float* vs,
            int64_t hkv, int64_t bs, const RowsIn& rows, double scale, int64_t window,
            const c10::optional<at::Tensor>& sinks, int64_t kind, int64_t isa, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [N, H_q, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be fp32 or bf16");
  const int64_t hq = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 8 == 0 && hq % hkv == 0 && hq / hkv <= 64, "head_dim must be a multiple of 8, G <= 64");
  TORCH_CHECK(kind != KIND_FP8 || (ks != nullptr && vs != nullptr), "an FP8 pool needs its scales");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == hq), "sinks must be contiguous fp32 [H_q]");
  check_rows(rows);
  TORCH_CHECK(rows.row_seq.numel() >= n && rows.prefix.numel() >= n && rows.extra_start.numel() > n,
              "the pass's rows describe fewer rows than are attended");
  Pass p{q.data_ptr(), k_data, v_data, ks, vs, out.data_ptr(), rows.tables.data_ptr<int64_t>(), rows.tables.size(1),
         rows.row_seq.data_ptr<int64_t>(), rows.prefix.data_ptr<int64_t>(), rows.extra_start.data_ptr<int64_t>(),
         rows.extra_keys.data_ptr<int64_t>(), hq, hkv, d, bs, static_cast<float>(scale),
         window, sinks.has_value() ? sinks->data_ptr<float>() : nullptr,
         q.scalar_type() == at::kBFloat16, kind};
  const std::vector<int64_t> groups = row_groups(p, n);
  const int64_t n_groups = static_cast<int64_t>(groups.size() - 1), tasks = n_groups * hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    if (isa >= 1) run_range_avx2(p, groups.data(), n_groups, begin, end);
    else run_range(p, groups.data(), n_groups, begin, end);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& prefix,
                           const at::Tensor& extra_start, const at::Tensor& extra_keys, double scale,
                           int64_t window, const c10::optional<at::Tensor>& sinks, int64_t kind, int64_t isa) {
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous(), "pools must be contiguous [blocks, BS, H_kv, D]");
  TORCH_CHECK(kind != KIND_FP8 || (k_scale.has_value() && v_scale.has_value()), "an FP8 pool needs its scales");
  auto out = at::empty_like(q);
  attend(q, q.size(0), k.data_ptr(), v.data_ptr(), kind == KIND_FP8 ? k_scale->data_ptr<float>() : nullptr,
         kind == KIND_FP8 ? v_scale->data_ptr<float>() : nullptr, k.size(2), k.size(1),
         RowsIn{tables, row_seq, prefix, extra_start, extra_keys}, scale, window, sinks, kind, isa, out);
  return out;
}

// One row's H_kv x D values (x, in fp32 or bf16, its last two dims contiguous) into the pool
// slot's: rounded to the pool's dtype as torch's .to() rounds (bf16: to nearest even); FP8 as
// engine.cache.kv_cache.quantize_fp8: scale = max(amax / 448, 1e-12) per head, then
// clamp(x / scale, -448, 448) to e4m3 (c10's conversion, which torch's copy uses).
template <typename In>
void store_row(const In* x, int64_t hkv, int64_t d, int64_t kind, void* pool, float* scales, int64_t slot) {
  const int64_t at = slot * hkv * d;
  for (int64_t h = 0; h < hkv; ++h) {
    const In* xh = x + h * d;
    if (kind == KIND_F32) {
      float* dst = static_cast<float*>(pool) + at + h * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(xh[i]);
    } else if (kind == KIND_BF16) {
      at::BFloat16* dst = static_cast<at::BFloat16*>(pool) + at + h * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<at::BFloat16>(static_cast<float>(xh[i]));
    } else {
      float amax = 0.0f;
      for (int64_t i = 0; i < d; ++i) amax = std::fmax(amax, std::fabs(static_cast<float>(xh[i])));
      float s = amax / 448.0f;
      s = s < 1e-12f ? 1e-12f : s;
      scales[slot * hkv + h] = s;
      at::Float8_e4m3fn* dst = static_cast<at::Float8_e4m3fn*>(pool) + at + h * d;
      for (int64_t i = 0; i < d; ++i) {
        float y = static_cast<float>(xh[i]) / s;
        y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
        dst[i] = static_cast<at::Float8_e4m3fn>(y);
      }
    }
  }
}

// A pool as store_rows writes it: per layer, `capacity` slots of H_kv x D elements of `elem`
// bytes, from `data` (FP8: one scale per slot and head, from `scales`; else null)
struct PoolAt {
  char* data; float* scales; int64_t capacity, hkv, d, elem;
};

// The first n rows of x [N, H_kv, D] into their slots of layer `layer`'s pool
void store_rows(const at::Tensor& given, int64_t n, const PoolAt& pool, int64_t layer, const int64_t* slots,
                int64_t kind) {
  const int64_t hkv = pool.hkv, d = pool.d, per_layer = pool.capacity * hkv * d;
  TORCH_CHECK(given.dim() == 3 && given.size(1) == hkv && given.size(2) == d, "storing K/V: k and v [N, H_kv, D]");
  const at::Tensor x = given.stride(2) == 1 && given.stride(1) == d ? given : given.contiguous();   // rows may be apart
  char* base = pool.data + layer * per_layer * pool.elem;
  float* sc = pool.scales != nullptr ? pool.scales + layer * (per_layer / d) : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool.capacity, "storing K/V: slot ", slots[i], " is outside the pool (",
                pool.capacity, " slots)");
    if (x.scalar_type() == at::kBFloat16)
      store_row(x.data_ptr<at::BFloat16>() + i * x.stride(0), hkv, d, kind, base, sc, slots[i]);
    else
      store_row(x.data_ptr<float>() + i * x.stride(0), hkv, d, kind, base, sc, slots[i]);
  }
}

// A pass's new keys and values into their slots of a float pool ([blocks, BS, H_kv, D], fp32 or
// bf16), rounded to the pool's dtype (store_rows): one call a layer where the torch path took six ops.
void store_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16,
              "store_kv writes fp32 or bf16 pools (an FP8 pool is quantized in torch)");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && slots.scalar_type() == at::kLong,
              "store_kv: contiguous pools [blocks, BS, H_kv, D] and int64 slots expected");
  const at::Tensor s = slots.contiguous();
  const int64_t kind = k_pool.scalar_type() == at::kBFloat16 ? KIND_BF16 : KIND_F32;
  auto widened = [](const at::Tensor& x) {      // store_rows reads fp32 or bf16
    return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat);
  };
  auto at_pool = [](at::Tensor& pool) {
    return PoolAt{static_cast<char*>(pool.data_ptr()), nullptr, pool.size(0) * pool.size(1), pool.size(2),
                  pool.size(3), pool.element_size()};
  };
  store_rows(widened(k), s.numel(), at_pool(k_pool), 0, s.data_ptr<int64_t>(), kind);
  store_rows(widened(v), s.numel(), at_pool(v_pool), 0, s.data_ptr<int64_t>(), kind);
}

// RoPE, rotate-half (transformers' Llama), on the first n rows of x [N, H, D] (its last dim
// contiguous), with each row's cos and sin [N, 1, D] in x's dtype: x * cos + cat(-x2, x1) * sin,
// each product and the sum rounded to the dtype, as the torch ops round (engine.models.llama.apply_rope).
// lanes(from, to) computes elements [from, to) of each half; the scalar loop is the definition.
template <typename T>
static inline void rope_scalar(const T* xr, const T* c, const T* s, T* o, int64_t half, int64_t from) {
  auto f = [](T v) { return static_cast<float>(v); };
  for (int64_t d = from; d < half; ++d) {
    const T a = static_cast<T>(f(xr[d]) * f(c[d])), b = static_cast<T>(-f(xr[d + half]) * f(s[d]));
    o[d] = static_cast<T>(f(a) + f(b));
    const T a2 = static_cast<T>(f(xr[d + half]) * f(c[d + half])), b2 = static_cast<T>(f(xr[d]) * f(s[d + half]));
    o[d + half] = static_cast<T>(f(a2) + f(b2));
  }
}

// 8 lanes at a time, the same bits: IEEE products and sums lane by lane (no FMA: the file builds
// with -ffp-contract=off and these are separate intrinsics), bf16 rounded as c10 rounds (nearest
// even on the bits, a NaN to 0x7FC0), and a negation, which is exact, before its product as the
// definition has it.
__attribute__((target("avx2"))) static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) static inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2"))) static inline __m256 round8(__m256 x, float) { return x; }
// cpu_fused.h's rounding to nearest even; a NaN as c10 writes it (0x7FC0), not with its payload
__attribute__((target("avx2"))) static inline __m256 round8(__m256 x, at::BFloat16) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(workbench_fused::round8_bf16(x), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}
__attribute__((target("avx2"))) static inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
__attribute__((target("avx2"))) static inline void store8(at::BFloat16* p, __m256 x) {    // x already rounded
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename T>
__attribute__((target("avx2"))) static void rope_avx2(const T* xr, const T* c, const T* s, T* o, int64_t half) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const T tag{};
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = load8(xr + d), x2 = load8(xr + d + half);
    const __m256 a = round8(_mm256_mul_ps(x1, load8(c + d)), tag);
    const __m256 b = round8(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(s + d)), tag);
    store8(o + d, round8(_mm256_add_ps(a, b), tag));
    const __m256 a2 = round8(_mm256_mul_ps(x2, load8(c + d + half)), tag);
    const __m256 b2 = round8(_mm256_mul_ps(x1, load8(s + d + half)), tag);
    store8(o + d + half, round8(_mm256_add_ps(a2, b2), tag));
  }
  rope_scalar(xr, c, s, o, half, d);
}

template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t n, at::Tensor& out,
               bool avx2) {
  const int64_t H = x.size(1), D = x.size(2), half = D / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const T* xr = xp + i * x.stride(0) + h * x.stride(1);
      const T* c = cp + i * cos.stride(0);
      const T* s = sp + i * sin.stride(0);
      T* o = op + (i * H + h) * D;
      if (avx2) rope_avx2(xr, c, s, o, half);
      else rope_scalar(xr, c, s, o, half, 0);
    }
}

// x rotated, into `buffer` (this thread's, reused every call: no allocation a layer)
at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t n,
                   std::vector<char>& buffer, bool avx2) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "attend_layer: q and k [N, H, D], D even");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) >= n && cos.size(2) == x.size(2) && cos.stride(2) == 1 &&
              sin.sizes() == cos.sizes() && sin.strides() == cos.strides() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "attend_layer: cos and sin [N, 1, D] in q's dtype");
  buffer.resize(static_cast<size_t>(x.numel() * x.element_size()));
  at::Tensor out = at::from_blob(buffer.data(), {x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kBFloat16) rope_rows<at::BFloat16>(x, cos, sin, n, out, avx2);
  else rope_rows<float>(x, cos, sin, n, out, avx2);
  return out;
}

// ---- the compiled step's attention op: one call a layer, every input an argument ----------------
// The whole pool as bytes (every layer: [L, blocks, BS, H_kv, D * the element's bytes]; its dtype
// is the element's width: 4 fp32, 2 bf16, 1 FP8 with fp32 scales [L, blocks, BS, H_kv], ignored
// otherwise), which it writes (the schema says so), the pass's slots and rows, and the layer: it
// stores the layer's new K/V and attends in one C++ call, keeping nothing between calls. The pool
// travels as bytes so that one graph serves every KV dtype (the dtype is data, not a guard).
at::Tensor attend_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_bytes,
                        at::Tensor& v_bytes, const c10::optional<at::Tensor>& k_scale,
                        const c10::optional<at::Tensor>& v_scale, const at::Tensor& slots, const at::Tensor& tables,
                        const at::Tensor& row_seq, const at::Tensor& prefix, const at::Tensor& extra_start,
                        const at::Tensor& extra_keys, int64_t layer, double scale, int64_t window,
                        const c10::optional<at::Tensor>& sinks, int64_t isa, const c10::optional<at::Tensor>& cos,
                        const c10::optional<at::Tensor>& sin) {
  TORCH_CHECK(k_bytes.dim() == 5 && k_bytes.is_contiguous() && v_bytes.is_contiguous() && k_bytes.sizes() == v_bytes.sizes() &&
              k_bytes.scalar_type() == at::kByte && v_bytes.scalar_type() == at::kByte,
              "attend_layer: the pool's k and v as bytes, contiguous [L, blocks, BS, H_kv, D * element bytes]");
  TORCH_CHECK(q.dim() == 3 && q.size(2) > 0 && k_bytes.size(4) % q.size(2) == 0, "attend_layer: q [N, H_q, D], D the pool's");
  const int64_t width = k_bytes.size(4) / q.size(2);
  TORCH_CHECK(width == 1 || width == 2 || width == 4, "attend_layer: an fp32, bf16 or FP8 pool (", width,
              " bytes an element)");
  const bool fp8 = width == 1;
  // the pool read in place as elements of `width` bytes: [L, blocks, BS, H_kv, D] (no view made)
  const int64_t layers = k_bytes.size(0), blocks = k_bytes.size(1), bs = k_bytes.size(2), hkv = k_bytes.size(3),
                d = q.size(2), elements = k_bytes.numel() / width;
  TORCH_CHECK(!fp8 || (k_scale.has_value() && v_scale.has_value() && k_scale->is_contiguous() &&
                       v_scale->is_contiguous() && k_scale->scalar_type() == at::kFloat &&
                       v_scale->scalar_type() == at::kFloat && k_scale->numel() * d == elements &&
                       v_scale->numel() == k_scale->numel()),
              "attend_layer: an FP8 pool needs its fp32 scales [L, blocks, BS, H_kv]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "attend_layer: int64 slots");
  const RowsIn rows{tables, row_seq, prefix, extra_start, extra_keys};
  check_rows(rows);
  TORCH_CHECK(row_seq.numel() == slots.numel(), "attend_layer: one slot per row");
  TORCH_CHECK(layer >= 0 && layer < layers, "attend_layer: no layer ", layer, " in the pool");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16), "attend_layer: fp32 or bf16 q, k, v");
  const int64_t n = slots.numel(), total = q.size(0);
  TORCH_CHECK(n >= 1 && total >= n && k.size(0) == total && v.size(0) == total,
              "attend_layer: the pass has ", n, " rows, the graph gave ", total);
  const int64_t kind = fp8 ? KIND_FP8 : width == 2 ? KIND_BF16 : KIND_F32;
  float* ks = fp8 ? k_scale->data_ptr<float>() : nullptr;
  float* vs = fp8 ? v_scale->data_ptr<float>() : nullptr;
  const int64_t* slot_ids = slots.data_ptr<int64_t>();
  const PoolAt k_at{static_cast<char*>(k_bytes.data_ptr()), ks, blocks * bs, hkv, d, width};
  const PoolAt v_at{static_cast<char*>(v_bytes.data_ptr()), vs, blocks * bs, hkv, d, width};
  // cos and sin: q and k are rotated here (RoPE), as they are stored and read
  const bool rope = cos.has_value() && cos->defined();
  TORCH_CHECK(rope == (sin.has_value() && sin->defined()), "attend_layer: cos and sin, or neither");
  thread_local std::vector<char> k_rotated, q_rotated;
  store_rows(rope ? rotated(k, *cos, *sin, n, k_rotated, isa >= 1) : k, n, k_at, layer, slot_ids, kind);
  store_rows(v, n, v_at, layer, slot_ids, kind);
  const at::Tensor qc = rope ? rotated(q, *cos, *sin, n, q_rotated, isa >= 1) : q.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const int64_t per_layer = blocks * bs * hkv * d, per_scale = blocks * bs * hkv;
  const c10::optional<at::Tensor> sinks32 =
      sinks.has_value() ? c10::optional<at::Tensor>(sinks->detach().to(at::kFloat).contiguous()) : c10::nullopt;
  attend(qc, n, k_at.data + layer * per_layer * width, v_at.data + layer * per_layer * width,
         fp8 ? ks + layer * per_scale : nullptr, fp8 ? vs + layer * per_scale : nullptr,
         hkv, bs, rows, scale, window, sinks32, kind, isa, out);
  if (total > n) {      // padding rows repeat the last (attention_op's contract)
    const int64_t row = out.numel() / total * out.element_size();
    char* o = static_cast<char*>(out.data_ptr());
    for (int64_t i = n; i < total; ++i) std::memcpy(o + i * row, o + (n - 1) * row, row);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("store_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor? k_scale, Tensor? v_scale, Tensor tables, "
        "Tensor row_seq, Tensor prefix, Tensor extra_start, Tensor extra_keys, float scale, int window, Tensor? sinks, "
        "int kind, int isa) -> Tensor");
  m.def("attend_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) k_bytes, Tensor(b!) v_bytes, Tensor(c!)? k_scale, "
        "Tensor(d!)? v_scale, Tensor slots, Tensor tables, Tensor row_seq, Tensor prefix, Tensor extra_start, "
        "Tensor extra_keys, int layer, float scale, int window, Tensor? sinks, int isa, Tensor? cos=None, "
        "Tensor? sin=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
  m.impl("attend_layer", &attend_layer);
}

