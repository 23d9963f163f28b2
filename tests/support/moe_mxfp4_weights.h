#pragma once
// MXFP4 weights (kernels/mxfp4.h's layout) made on the host for the MoE tests: random e2m1
// codes with e8m0 scales near a given size, packed low nibble first, and the same weights
// widened to float by this file's own decoding (a table of the eight magnitudes and the
// sign bit, times 2^(s - 127)), not the kernels' helpers. Rows are padded past their columns:
// the padding's scale bytes are 0xff (NaN), so a kernel that reads past a row shows it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/mxfp4.h"

namespace spark::test {

// The e2m1 value of code c (its low 4 bits), from the format's table: bit 3 the sign, bits
// 2-0 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline double e2m1_decoded(uint8_t c) {
  static const double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8) ? -kMag[c & 7] : kMag[c & 7];
}

struct Mxfp4Host {
  size_t rows = 0, cols = 0, ldb = 0, lds = 0;
  std::vector<uint8_t> blocks, scales;

  kernels::Mxfp4Weight weight() const {
    kernels::Mxfp4Weight w;
    w.blocks = blocks.data(), w.ldb = ldb, w.scales = scales.data(), w.lds = lds;
    return w;
  }
  uint8_t code(size_t r, size_t c) const {
    const uint8_t b = blocks[r * ldb + c / 2];
    return c % 2 == 0 ? (b & 0xf) : (b >> 4);
  }
  double value(size_t r, size_t c) const {
    return e2m1_decoded(code(r, c)) *
           std::pow(2.0, static_cast<int>(scales[r * lds + c / 32]) - 127);
  }
  /// [rows][cols] each weight as a float (exact).
  std::vector<float> widened() const {
    std::vector<float> w(rows * cols);
    for (size_t r = 0; r < rows; ++r)
      for (size_t c = 0; c < cols; ++c) w[r * cols + c] = static_cast<float>(value(r, c));
    return w;
  }
};

/// A [rows][cols] MXFP4 weight (cols a multiple of 32) whose values lie within about
/// +-6 * scale: random codes, each block's scale 2^(ilogb(scale) - 1 + {-1, 0, 1}). Rows
/// padded by 16 bytes of codes and 3 scale bytes (0xff).
inline Mxfp4Host make_mxfp4(std::mt19937& rng, size_t rows, size_t cols, float scale) {
  Mxfp4Host h;
  h.rows = rows, h.cols = cols;
  h.ldb = cols / 2 + 16;
  h.lds = cols / 32 + 3;
  h.blocks.assign(std::max<size_t>(1, rows * h.ldb), 0x77);
  h.scales.assign(std::max<size_t>(1, rows * h.lds), 0xff);
  std::uniform_int_distribution<int> nib(0, 15), shift(-1, 1);
  const int e0 = 127 + std::ilogb(scale) - 1;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t b = 0; b < cols / 2; ++b)
      h.blocks[r * h.ldb + b] = static_cast<uint8_t>(nib(rng) | nib(rng) << 4);
    for (size_t s = 0; s < cols / 32; ++s)
      h.scales[r * h.lds + s] = static_cast<uint8_t>(e0 + shift(rng));
  }
  return h;
}

}  // namespace spark::test
