#pragma once
// MXFP4 weights kept packed as stored (provisional: the layout only).
#include <cstddef>
#include <cstdint>

namespace spark::kernels {

inline constexpr int kMxfp4BlockK = 32;

/// An MXFP4 weight [n][k]: row r's packed bytes at blocks + r * ldb (k / 2 bytes, column 2j
/// in byte j's low nibble), its e8m0 scales at scales + r * lds (k / 32 bytes).
struct Mxfp4Weight {
  const uint8_t* blocks = nullptr;
  size_t ldb = 0;
  const uint8_t* scales = nullptr;
  size_t lds = 0;
};

}  // namespace spark::kernels
