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
  template <int BITS, int R, typename S>
  static void tile(const Rows& rows, int64_t row0, const Weight& wt, float* y, int64_t ldy, bool stream) {
    static_assert(R >= 1 && R <= 8, "one to eight rows a tile");
    const int64_t K = rows.K, G = rows.G, groups = K / G, xblocks = K / XB;
    const int64_t gb = BITS == 4 ? 256 : G * COLS;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const S* sc = static_cast<const S*>(wt.s);
    // row r's 4 bytes of k .. k + 3 lie at xq4 + (r / 4) * 4K + (k / 4) * 16 + (r % 4) * 4
    const int8_t* x0 = rows.xq4 + row0 * K;       // row0 is a multiple of 4
    const int8_t* x1 = x0 + 4 * K;
    const float* sx[R];
    const float* sxs[R];
    for (int r = 0; r < R; ++r) {
      sx[r] = rows.sx + (row0 + r) * xblocks;
      sxs[r] = rows.sxs + (row0 + r) * groups;
    }
    alignas(32) float acc[R][COLS];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = wt.w + g * gb;
      const int8_t* xg0 = x0 + g * G * 4;
      const int8_t* xg1 = x1 + g * G * 4;   // rows 4 .. 7
      auto xrow = [&](int r, int64_t at) {   // row r's 4 bytes at xq4 offset `at` in this group
        int32_t v;
        std::memcpy(&v, (r < 4 ? xg0 : xg1) + at + (r % 4) * 4, 4);
        return _mm256_set1_epi32(v);
      };
      if (stream) {     // the stream ahead (tiles lie one after another): weights, scales (a quarter the bytes)
        for (int64_t line = 0; line < gb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH_BYTES + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sc + g * 2 * COLS) + PREFETCH_BYTES / 4, _MM_HINT_T0);
      }
      const S* s = sc + g * 2 * COLS;
      const int64_t xb = g * G / XB;
      for (int h = 0; h < 2; ++h) {
        // the compiler would otherwise load every row's activations of the group once for both
        // halves and keep them on the stack (spilling the sums): a broadcast from L1 is cheaper
        asm("" : "+r"(xg0), "+r"(xg1));
        __m256i isum[R];
        if constexpr (BITS == 4) {
#if DOT_VNNI
          for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#else
          __m256i p16[R];             // 8 pairs of at most 2 * 15 * 127: under 32767
#endif
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; ++r) {
              const __m256i xa = xrow(r, j * 16), xc = xrow(r, (4 + j) * 16);
#if DOT_VNNI
              isum[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum[r]), __v8si(lo), __v8si(xa)));
              isum[r] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(isum[r]), __v8si(hi), __v8si(xc)));
#else
              const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xc));
              p16[r] = j == 0 ? both : _mm256_add_epi16(p16[r], both);
              asm("" : "+x"(p16[r]));    // add as we go: reassociated, every product waits on the stack
#endif
            }
          }
#if !DOT_VNNI
          for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1));
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
          for (int r = 0; r < R; ++r) isum[r] = _mm256_set1_epi32(128 * rows.xsum[(row0 + r) * groups + g]);
#pragma GCC unroll 8
          for (int j = 0; j < G / 4; ++j) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + h * 32)), flip);
            const __m256i aq = _mm256_abs_epi8(q);
            for (int r = 0; r < R; ++r) {
              const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xrow(r, j * 16), q));
              isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
              asm("" : "+x"(isum[r]));
            }
          }
#endif
        }
        const __m256 dv = scales8_256<S>(s + h * 8), mv = scales8_256<S>(s + COLS + h * 8);
        for (int r = 0; r < R; ++r) {
          __m256 a = _mm256_load_ps(acc[r] + h * 8);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r][xb])), a);
          a = _mm256_fmadd_ps(mv, _mm256_set1_ps(sxs[r][g]), a);
          _mm256_store_ps(acc[r] + h * 8, a);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + h * 8, _mm256_load_ps(acc[r] + h * 8));
  }
};
