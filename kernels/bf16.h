#pragma once
// bfloat16 on the host as raw 16-bit patterns (the upper half of an IEEE float), so code
// that is not compiled by nvcc can build inputs for, and read outputs of, BF16 kernels.
#include <cstdint>
#include <cstring>

namespace spark::kernels {

/// A bfloat16 value as its bit pattern.
using bf16_bits = uint16_t;

/// Exact widening of a bfloat16 to float.
inline float bf16_to_float(bf16_bits b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Rounds a float to the nearest bfloat16 (ties to even), as __float2bfloat16 does; NaN
/// stays a (quiet) NaN.
inline bf16_bits float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<bf16_bits>((u >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>((u + rounding) >> 16);
}

}  // namespace spark::kernels
