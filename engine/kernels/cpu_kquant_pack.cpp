// workbench_cpu::kquant_pack_into — a GGUF file's K-quant rows (Q4_K, Q5_K, Q6_K super-blocks) into
// our quantized linear's tiles of 16 columns (cpu_quant_linear.cpp, "K-quants read as stored",
// has the layout; engine.kernels.cpu_kquant.pack_reference is the same repacking in torch ops, the
// definition the tests hold this to, byte for byte). The bytes are only moved and regrouped, so
// this runs at about the speed memory copies them: an 8B's 5 GB in seconds where the torch ops
// took minutes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t COLS = 16, SUPER = 256;

inline int64_t file_bytes(int64_t bits) { return bits == 4 ? 144 : bits == 5 ? 176 : 210; }
inline int planes_of(int64_t bits) { return bits == 5 ? 1 : bits == 6 ? 2 : 0; }
inline int64_t scale_bytes(int64_t bits) { return bits == 6 ? 16 * COLS + 2 * COLS : 8 * 24 + 4 * COLS; }
inline int64_t tile_bytes(int64_t bits) { return 8 * (256 + 64 * planes_of(bits)) + scale_bytes(bits); }

// One super-block of one row -> its 256 values u (0 .. 2^bits - 1), and (Q4_K, Q5_K) its 8
// six-bit scales and mins (ggml's get_scale_min_k4), or (Q6_K) its 16 int8 scales.
void decode_block(const uint8_t* b, int64_t bits, uint8_t* u, uint8_t* sc, uint8_t* mn) {
  if (bits == 6) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[h * 64 + l], c = ql[h * 64 + 32 + l], hi = qh[h * 32 + l];
        uint8_t* v = u + h * 128 + l;
        v[0] = (a & 0x0F) | ((hi & 3) << 4);
        v[32] = (c & 0x0F) | (((hi >> 2) & 3) << 4);
        v[64] = (a >> 4) | (((hi >> 4) & 3) << 4);
        v[96] = (c >> 4) | (((hi >> 6) & 3) << 4);
      }
    std::memcpy(sc, b + 192, 16);
    return;
  }
  const uint8_t* p = b + 4;             // 12 bytes of scales and mins
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 0x3F;
    mn[j] = p[4 + j] & 0x3F;
    sc[4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 2) & 0x30);
    mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
  }
  const uint8_t* qs = b + (bits == 4 ? 16 : 48);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) {
      u[64 * j + l] = qs[32 * j + l] & 0x0F;
      u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
    }
  if (bits == 5) {
    const uint8_t* qh = b + 16;         // bit j of byte l: value l of sub-block j
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) u[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
  }
}

// The 16 rows of one tile, one super-block: u[16][256], scales -> the tile's bytes
void pack_tile_block(const uint8_t* const* rows, int64_t bits, uint8_t* out) {
  uint8_t u[COLS][SUPER], sc[COLS][16], mn[COLS][8];
  for (int c = 0; c < COLS; ++c) decode_block(rows[c], bits, u[c], sc[c], mn[c]);
  const int pl = planes_of(bits);
  for (int g = 0; g < 8; ++g) {
    uint8_t* body = out + g * (256 + 64 * pl);
    for (int j = 0; j < 4; ++j) {
      uint8_t v[2][64];                 // per half: the 64 values c*4 + i of this j
      for (int c = 0; c < COLS; ++c) {
        uint32_t lo, hi;
        std::memcpy(&lo, &u[c][32 * g + 4 * j], 4);
        std::memcpy(&hi, &u[c][32 * g + 16 + 4 * j], 4);
        const uint32_t nib = (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
        std::memcpy(body + j * 64 + c * 4, &nib, 4);
        std::memcpy(&v[0][c * 4], &lo, 4);
        std::memcpy(&v[1][c * 4], &hi, 4);
      }
      // bit planes: per half (low nibbles, high ones), per plane a 64-bit mask over c*4+i;
      // 8 bytes' bit b gathered into one byte by the multiply trick (bit k of the result's top
      // byte is byte k's bit b)
      for (int half = 0; half < 2; ++half)
        for (int p = 0; p < pl; ++p) {
          uint8_t mask[8];
          for (int w = 0; w < 8; ++w) {
            uint64_t x;
            std::memcpy(&x, &v[half][8 * w], 8);
            mask[w] = static_cast<uint8_t>((((x >> (4 + p)) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
          }
          std::memcpy(body + 256 + ((j * 2 + half) * pl + p) * 8, mask, 8);    // little-endian
        }
    }
  }
  uint8_t* s = out + 8 * (256 + 64 * pl);
  if (bits == 6) {
    for (int sub = 0; sub < 16; ++sub)
      for (int c = 0; c < COLS; ++c) s[sub * COLS + c] = sc[c][sub];
    for (int c = 0; c < COLS; ++c) std::memcpy(s + 16 * COLS + 2 * c, rows[c] + 208, 2);
    return;
  }
  for (int g = 0; g < 8; ++g) {
    uint8_t* sg = s + g * 24;
    for (int c = 0; c < COLS; ++c) sg[c] = (sc[c][g] & 0x0F) | ((mn[c][g] & 0x0F) << 4);
    for (int c = 0; c < 8; ++c) {
      const uint8_t top = (sc[c][g] >> 4) | ((mn[c][g] >> 4) << 2);
      const uint8_t top8 = (sc[c + 8][g] >> 4) | ((mn[c + 8][g] >> 4) << 2);
      sg[16 + c] = top | (top8 << 4);
    }
  }
  for (int c = 0; c < COLS; ++c) {
    std::memcpy(s + 8 * 24 + 2 * c, rows[c], 2);                 // d
    std::memcpy(s + 8 * 24 + 2 * COLS + 2 * c, rows[c] + 2, 2);  // dmin
  }
}

// raw [N, K / 256 * file bytes] uint8 -> out [N / 16, K / 256, tile bytes] (a slice of a larger
// weight's tiles: a large linear is read a slice of rows at a time into its one tensor)
void kquant_pack_into(const at::Tensor& raw, int64_t bits, at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6, "kquant_pack: bits 4, 5 or 6 (Q4_K, Q5_K, Q6_K)");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "kquant_pack: contiguous uint8 rows of super-blocks [N, blocks * bytes]");
  const int64_t n = raw.size(0), row = raw.size(1), fb = file_bytes(bits);
  TORCH_CHECK(n % COLS == 0, "kquant_pack: ", n, " rows is not a multiple of ", COLS);
  TORCH_CHECK(row % fb == 0, "kquant_pack: a row of ", row, " bytes is not whole super-blocks of ", fb);
  const int64_t blocks = row / fb, tiles = n / COLS, tb = tile_bytes(bits);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 3 && out.size(0) == tiles &&
              out.size(1) == blocks && out.size(2) == tb, "kquant_pack: out must be contiguous uint8 [", tiles, ", ",
              blocks, ", ", tb, "]");
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const uint8_t* rows[COLS];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t sb = 0; sb < blocks; ++sb) {
        for (int c = 0; c < COLS; ++c) rows[c] = in + (t * COLS + c) * row + sb * fb;
        pack_tile_block(rows, bits, o + (t * blocks + sb) * tb);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("kquant_pack_into(Tensor raw, int bits, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("kquant_pack_into", &kquant_pack_into);
}
