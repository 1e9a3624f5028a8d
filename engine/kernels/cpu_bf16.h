// bf16 <-> fp32 for our CPU kernels (cpu_linear.cpp, cpu_quant_linear.cpp): widening is exact
// (a 16-bit shift); narrowing rounds to nearest even, as torch rounds.
#pragma once
#include <cstdint>
#include <cstring>

namespace workbench_bf16 {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);   // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace workbench_bf16
