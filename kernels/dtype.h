#pragma once
// Element types of the device entry points that take untyped (void*) buffers, and the
// rounding a reference twin applies where the device stores a value in that type.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "kernels/bf16.h"

namespace spark::kernels {

/// Storage type of an activation, KV or output buffer. e4m3 (FP8, one byte: sign, 4
/// exponent bits, 3 mantissa bits, at most 448) is a KV cache type only: the attention
/// kernels read it, the KV writes store it; activations are f32 or bf16.
enum class DType : uint8_t { f32, bf16, e4m3 };

/// Bytes per element of `t`.
inline constexpr size_t dtype_size(DType t) {
  return t == DType::bf16 ? 2 : t == DType::e4m3 ? 1 : 4;
}

/// "f32", "bf16" or "fp8", for messages.
inline constexpr const char* dtype_name(DType t) {
  return t == DType::bf16 ? "bf16" : t == DType::e4m3 ? "fp8" : "f32";
}

/// The value of e4m3 code `c` (NaN for 0x7f and 0xff).
inline float fp8_e4m3_value(uint8_t c) {
  const int e = (c >> 3) & 0xf, mant = c & 0x7;
  float x;
  if (e == 0xf && mant == 0x7)
    x = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0)
    x = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant/8 x 2^-6
  else
    x = std::ldexp(static_cast<float>(8 + mant), e - 10);  // (1 + mant/8) x 2^(e-7)
  return (c & 0x80) ? -x : x;
}

/// The e4m3 code of `v`: round to nearest even, saturating at +-448 (NaN: 0x7f), as the
/// device's cvt.rn.satfinite stores it.
inline uint8_t fp8_e4m3_code(float v) {
  if (std::isnan(v)) return 0x7f;
  // The 127 finite non-negative codes' values, ascending (code c for c < 0x7f).
  static const auto pos = [] {
    std::array<float, 0x7f> t{};
    for (int c = 0; c < 0x7f; ++c)
      t[static_cast<size_t>(c)] = fp8_e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::fabs(v);
  if (a >= pos.back()) return static_cast<uint8_t>(sign | 0x7e);  // saturate at 448
  // The first code not below a, and the nearest of it and the one before (ties: even code).
  const size_t hi = static_cast<size_t>(std::lower_bound(pos.begin(), pos.end(), a) - pos.begin());
  if (hi == 0) return sign;
  const size_t lo = hi - 1;
  const float dl = a - pos[lo], dh = pos[hi] - a;
  const size_t c = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint8_t>(sign | c);
}

/// `v` as it reads back after being stored as `t` (bf16: round to nearest even; e4m3:
/// round to nearest even, saturated).
inline float round_to(DType t, float v) {
  return t == DType::bf16   ? bf16_to_float(float_to_bf16(v))
         : t == DType::e4m3 ? fp8_e4m3_value(fp8_e4m3_code(v))
                            : v;
}

}  // namespace spark::kernels
