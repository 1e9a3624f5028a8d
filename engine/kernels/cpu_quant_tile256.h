// The 256-bit tile of workbench_cpu::linear_q (cpu_quant_linear.cpp), written once and
// included once per 256-bit instruction set, inside that set's `#pragma GCC target` region:
//   TILE256   the struct's name;
//   DOT_VNNI  1: U accumulates by vpdpbusd (AVX-VNNI's VEX form, or AVX-512 VL's EVEX form: the
//                same builtin, encoded by the region's target), 0: by vpmaddubsw + vpmaddwd (AVX2).
// One tile of 16 output columns by R <= 4 rows, as two halves of 8 columns (one ymm each). Each
// weight vector is loaded and decoded once for all R rows, and the rows' integer sums and float
// accumulators stay in the 16 registers: up to two rows take both halves in one pass over K
// (more independent chains), three or four rows take one half a pass (the second pass reads
// the tile's other 32 bytes of each line from L1). The arithmetic is the file's: U exact, then
// the two fmas in order over K, whatever the pass.
//
struct TILE256 {
  template <int BITS, int R, typename S>
  static void tile(const Rows& rows, int64_t row0, const Weight& wt, float* y, int64_t ldy) {
    static_assert(R >= 1 && R <= 4, "one to four rows a tile");
    if constexpr (R <= 2) {
      pass<BITS, R, 2, S>(rows, row0, wt, y, ldy, 0);
    } else {
      pass<BITS, R, 1, S>(rows, row0, wt, y, ldy, 0);
      pass<BITS, R, 1, S>(rows, row0, wt, y, ldy, 1);
    }
  }

  // halves h0 .. h0 + NH - 1 of the tile, over all of K
  template <int BITS, int R, int NH, typename S>
  static void pass(const Rows& rows, int64_t row0, const Weight& wt, float* y, int64_t ldy, int h0) {
    const int64_t K = rows.K, G = rows.G, groups = K / G, xblocks = K / XB;
    const int64_t gb = BITS == 4 ? 256 : G * COLS;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const S* sc = static_cast<const S*>(wt.s);
    __m256 acc[R][NH];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < NH; ++h) acc[r][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = wt.w + g * gb;
      const int8_t* xg = rows.xq4 + row0 * K + g * G * 4;     // row0 is a multiple of 4
      if (h0 == 0) {    // the stream ahead (tiles lie one after another): weights, scales (a quarter the bytes)
        for (int64_t line = 0; line < gb; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH_BYTES + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sc + g * 2 * COLS) + PREFETCH_BYTES / 4, _MM_HINT_T0);
      }
      __m256i isum[R][NH];
      if constexpr (BITS == 4) {      // u <= 15: every vpmaddubsw pair fits int16
#if DOT_VNNI
        __m256i a0[R][NH], a1[R][NH];   // two chains each: the low and the high nibbles
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h) a0[r][h] = a1[r][h] = _mm256_setzero_si256();
#else
        __m256i p16[R][NH];             // 8 pairs of at most 2 * 15 * 127: under 32767
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h) p16[r][h] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m256i lo[NH], hi[NH];
          for (int h = 0; h < NH; ++h) {
            const int64_t at = j * 64 + (h0 + h) * 32;
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + at));
            lo[h] = _mm256_and_si256(v, low);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          }
          for (int r = 0; r < R; ++r) {
            int32_t a, c;
            std::memcpy(&a, xg + j * 16 + r * 4, 4);
            std::memcpy(&c, xg + (4 + j) * 16 + r * 4, 4);
            const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(c);
            for (int h = 0; h < NH; ++h) {
#if DOT_VNNI
              a0[r][h] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(a0[r][h]), __v8si(lo[h]), __v8si(xa)));
              a1[r][h] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(a1[r][h]), __v8si(hi[h]), __v8si(xc)));
#else
              p16[r][h] = _mm256_add_epi16(p16[r][h], _mm256_maddubs_epi16(lo[h], xa));
              p16[r][h] = _mm256_add_epi16(p16[r][h], _mm256_maddubs_epi16(hi[h], xc));
#endif
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h)
#if DOT_VNNI
            isum[r][h] = _mm256_add_epi32(a0[r][h], a1[r][h]);
#else
            isum[r][h] = _mm256_madd_epi16(p16[r][h], _mm256_set1_epi16(1));
#endif
      } else {
#if DOT_VNNI
        // u in 0..255 as stored; two chains each when few rows share the tile
        constexpr int P = R * NH <= 2 ? 2 : 1;
        __m256i part[R][NH][P];
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h)
            for (int p = 0; p < P; ++p) part[r][h][p] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < G / 4; ++j) {
          __m256i v[NH];
          for (int h = 0; h < NH; ++h)
            v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + (h0 + h) * 32));
          for (int r = 0; r < R; ++r) {
            int32_t a;
            std::memcpy(&a, xg + j * 16 + r * 4, 4);
            const __m256i xa = _mm256_set1_epi32(a);
            for (int h = 0; h < NH; ++h)
              part[r][h][j % P] = __m256i(__builtin_ia32_vpdpbusd_v8si(__v8si(part[r][h][j % P]), __v8si(v[h]), __v8si(xa)));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h)
            isum[r][h] = P == 2 ? _mm256_add_epi32(part[r][h][0], part[r][h][P - 1]) : part[r][h][0];
#else
        // u = q + 128 would overflow a vpmaddubsw pair: |q| * sign(xq, q) is at most
        // 2 * 128 * 127 = 32512 a pair, and U = sum(q * xq) + 128 * sum(xq), exactly
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < NH; ++h) isum[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < G / 4; ++j) {
          __m256i q[NH], aq[NH];
          for (int h = 0; h < NH; ++h) {
            q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64 + (h0 + h) * 32)), flip);
            aq[h] = _mm256_abs_epi8(q[h]);
          }
          for (int r = 0; r < R; ++r) {
            int32_t a;
            std::memcpy(&a, xg + j * 16 + r * 4, 4);
            const __m256i xa = _mm256_set1_epi32(a);
            for (int h = 0; h < NH; ++h) {
              const __m256i p = _mm256_maddubs_epi16(aq[h], _mm256_sign_epi8(xa, q[h]));
              isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256i zero_point = _mm256_set1_epi32(128 * rows.xsum[(row0 + r) * groups + g]);
          for (int h = 0; h < NH; ++h) isum[r][h] = _mm256_add_epi32(isum[r][h], zero_point);
        }
#endif
      }
      const S* s = sc + g * 2 * COLS;
      const int64_t xb = g * G / XB;
      for (int h = 0; h < NH; ++h) {
        const __m256 dv = scales8_256<S>(s + (h0 + h) * 8), mv = scales8_256<S>(s + COLS + (h0 + h) * 8);
        for (int r = 0; r < R; ++r) {
          const float sx = rows.sx[(row0 + r) * xblocks + xb], sxs = rows.sxs[(row0 + r) * groups + g];
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(dv, _mm256_set1_ps(sx)), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sxs), acc[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < NH; ++h) _mm256_storeu_ps(y + r * ldy + (h0 + h) * 8, acc[r][h]);
  }
};
