// The 256-bit tile of workbench_cpu::linear_q (cpu_quant_linear.cpp), written once and
// included once per 256-bit instruction set, inside that set's `#pragma GCC target` region:
//   TILE256   the struct's name;
//   DOT_VNNI  1: U accumulates by vpdpbusd (AVX-VNNI's VEX form, or AVX-512 VL's EVEX form: the
//                same builtin, encoded by the region's target), 0: by vpmaddubsw + vpmaddwd (AVX2).
// One tile of 16 output columns by R <= 8 rows in one pass over K. Per group, each half of 8
// columns (one ymm) is decoded once for all R rows, and the rows' integer sums of that half
// stay in registers (R of them) while the float accumulators wait in L1 between groups: the
// inner loop keeps every register it needs without spilling, and a weight vector is decoded
// once per R rows, not once per row. The arithmetic is the file's: U exact, then the two fmas
// in order over K.
//
// Cost per 32 weights x row (4-bit, AVX2): one vpmaddubsw and one vpaddw (int16 sums of at
// most 8 pairs of 2 * 15 * 127: no saturation), one broadcast load, and 1/R of the decode (load,
// shift, two ands per 64 weights); per 8 columns x group x row: vpmaddwd, cvt, mul, two fmas.
// AVX-VNNI: one vpdpbusd per 32 weights x row.
//
struct TILE256 {
  // A K-quant's high bits: plane bytes (32 bits of a 64-bit mask, for this half's 32 bytes) ->
  // `bit` where set (AVX2 has no byte masks)
  static inline __m256i plane(const uint8_t* p, __m256i bit) {
    uint32_t m;
    std::memcpy(&m, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), bit);
  }

  template <int F, int R, typename S>
  static void tile(const Rows& rows, int64_t row0, const Weight& wt, float* y, int64_t ldy, bool stream) {
    static_assert(R >= 1 && R <= 8, "one to eight rows a tile");
    constexpr bool KF = kfmt(F), NIB = F != 8, SPLIT = F == KQ6;
    constexpr int PL = planes(F);
    const int64_t K = rows.K, G = rows.G, xblocks = K / XB, sums = K / G;
    const int64_t gk = NIB ? 32 : G, groups = K / gk;     // k a group of the loop
    const int64_t gb = KF ? kgroup_bytes(F) : group_bytes(F, G);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const S* sc = static_cast<const S*>(wt.s);
    alignas(32) float dm[KF ? 8 * ksubs(F) * 2 * COLS : 1];
    // row r's 4 bytes of k .. k + 3 lie at xq4 + (r / 4) * 4K + (k / 4) * 16 + (r % 4) * 4
    const int8_t* x0 = rows.xq4 + row0 * K;       // row0 is a multiple of 4
    const int8_t* x1 = x0 + 4 * K;
    const float* sx[R];
    const float* sxs[R];
    for (int r = 0; r < R; ++r) {
      sx[r] = rows.sx + (row0 + r) * xblocks;
      sxs[r] = rows.sxs + (row0 + r) * sums;
    }
    alignas(32) float acc[R][COLS];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg;
      if constexpr (KF) {
        wg = kgroup<F>(wt.w, g);
        if ((g & 7) == 0) kscales_avx2<F>(kscales_of<F>(wt.w, g), dm);
      } else {
        wg = wt.w + g * gb;
      }
      const int8_t* xg0 = x0 + g * gk * 4;
      const int8_t* xg1 = x1 + g * gk * 4;   // rows 4 .. 7
      auto xrow = [&](int r, int64_t at) {   // row r's 4 bytes at xq4 offset `at` in this group
        int32_t v;
        std::memcpy(&v, (r < 4 ? xg0 : xg1) + at + (r % 4) * 4, 4);
        return _mm256_set1_epi32(v);
      };
      if (stream) {     // the stream ahead (tiles lie one after another): weights, scales (a quarter the bytes)
        for (int64_t line = 0; line < gb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH_BYTES + line), _MM_HINT_T0);
        if constexpr (!KF) _mm_prefetch(reinterpret_cast<const char*>(sc + g * 2 * COLS) + PREFETCH_BYTES / 4, _MM_HINT_T0);
      }
      const int64_t xb = g * gk / XB;
      for (int h = 0; h < 2; ++h) {
        // the compiler would otherwise load every row's activations of the group once for both
        // halves and keep them on the stack (spilling the sums): a broadcast from L1 is cheaper
        asm("" : "+r"(xg0), "+r"(xg1));
        __m256i isum[R], isum2[SPLIT ? R : 1];
        if constexpr (NIB) {
          for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
          if constexpr (SPLIT) for (int r = 0; r < R; ++r) isum2[r] = _mm256_setzero_si256();
#if !DOT_VNNI
          __m256i p16[R];             // 4-bit: 8 pairs of at most 2 * 15 * 127, under 32767
#endif
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32));
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (PL > 0) {
              const uint8_t* pl = wg + 256 + j * 16 * PL + h * 4;
              lo = _mm256_or_si256(lo, plane(pl, _mm256_set1_epi8(16)));
              hi = _mm256_or_si256(hi, plane(pl + 8 * PL, _mm256_set1_epi8(16)));
              if constexpr (PL == 2) {
                lo = _mm256_or_si256(lo, plane(pl + 8, _mm256_set1_epi8(32)));
                hi = _mm256_or_si256(hi, plane(pl + 24, _mm256_set1_epi8(32)));
              }
            }
            for (int r = 0; r < R; ++r) {
              const __m256i xa = xrow(r, j * 16), xc = xrow(r, (4 + j) * 16);
#if DOT_VNNI
              isum[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum[r]), __v8si(lo), __v8si(xa)));
              if constexpr (SPLIT)
                isum2[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum2[r]), __v8si(hi), __v8si(xc)));
              else
                isum[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum[r]), __v8si(hi), __v8si(xc)));
#else
              if constexpr (SPLIT) {        // a pair is at most 2 * 63 * 127: widened every j
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xa), ones));
                isum2[r] = _mm256_add_epi32(isum2[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xc), ones));
              } else if constexpr (PL > 0) {  // Q5_K: 2 pairs of at most 2 * 31 * 127 a j
                const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(both, ones));
              } else {
                const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
                p16[r] = j == 0 ? both : _mm256_add_epi16(p16[r], both);
                asm("" : "+x"(p16[r]));    // add as we go: reassociated, every product waits on the stack
              }
#endif
            }
          }
#if !DOT_VNNI
          if constexpr (PL == 0) for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(p16[r], ones);
#endif
        } else {
#if DOT_VNNI
          // u in 0..255 as stored
          for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int j = 0; j < G / 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32));
            for (int r = 0; r < R; ++r)
              isum[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum[r]), __v8si(v), __v8si(xrow(r, j * 16))));
          }
#else
          // u = q + 128 would overflow a vpmaddubsw pair: |q| * sign(xq, q) is at most
          // 2 * 128 * 127 = 32512 a pair, and U = sum(q * xq) + 128 * sum(xq), exactly
          const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
          for (int r = 0; r < R; ++r) isum[r] = _mm256_set1_epi32(128 * rows.xsum[(row0 + r) * sums + g]);
#pragma GCC unroll 8
          for (int j = 0; j < G / 4; ++j) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32)), flip);
            const __m256i aq = _mm256_abs_epi8(q);
            for (int r = 0; r < R; ++r) {
              const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xrow(r, j * 16), q));
              isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
              asm("" : "+x"(isum[r]));
            }
          }
#endif
        }
        for (int sub = 0; sub < ksubs(F); ++sub) {
          __m256 dv, mv;
          if constexpr (KF) {
            const float* s = dm + ((g & 7) * ksubs(F) + sub) * 2 * COLS;
            dv = _mm256_load_ps(s + h * 8);
            mv = _mm256_load_ps(s + COLS + h * 8);
          } else {
            const S* s = sc + g * 2 * COLS;
            dv = scales8_256<S>(s + h * 8);
            mv = scales8_256<S>(s + COLS + h * 8);
          }
          for (int r = 0; r < R; ++r) {
            const __m256i u = SPLIT && sub ? isum2[r] : isum[r];
            __m256 a = _mm256_load_ps(acc[r] + h * 8);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r][xb])), a);
            a = _mm256_fmadd_ps(mv, _mm256_set1_ps(sxs[r][g * ksubs(F) + sub]), a);
            _mm256_store_ps(acc[r] + h * 8, a);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + h * 8, _mm256_load_ps(acc[r] + h * 8));
  }
};
