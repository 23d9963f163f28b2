#pragma once
// Element types of the device entry points that take untyped (void*) buffers, and the
// rounding a reference twin applies where the device stores a value in that type.
#include <cstddef>
#include <cstdint>

#include "kernels/bf16.h"

namespace spark::kernels {

/// Storage type of an activation, KV or output buffer.
enum class DType : uint8_t { f32, bf16 };

/// Bytes per element of `t`.
inline constexpr size_t dtype_size(DType t) {
  return t == DType::bf16 ? 2 : 4;
}

/// "f32" or "bf16", for messages.
inline constexpr const char* dtype_name(DType t) {
  return t == DType::bf16 ? "bf16" : "f32";
}

/// `v` as it reads back after being stored as `t` (bf16: round to nearest even).
inline float round_to(DType t, float v) {
  return t == DType::bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

}  // namespace spark::kernels
