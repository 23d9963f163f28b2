#pragma once
// FP8 weights (kernels/fp8.h's layout) made on the host for the MoE tests: random e4m3 bytes
// of moderate size with block scales, and the same weights widened to float. The bytes past
// each row's columns and the scales past its blocks are NaN, so a kernel that reads them
// shows it.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/fp8.h"

namespace spark::test {

// The e4m3 value of byte v, decoded here on its own (sign, 4-bit exponent of bias 7,
// 3-bit mantissa; exponent 0 subnormal; 0x7f and 0xff NaN).
inline double e4m3_decoded(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 0xf, m = v & 0x7;
  if (e == 0xf && m == 0x7) return NAN;
  const double mag = e == 0 ? std::pow(2.0, -6) * (m / 8.0) : std::pow(2.0, e - 7) * (1 + m / 8.0);
  return s ? -mag : mag;
}

struct Fp8Host {
  size_t rows = 0, cols = 0, ldq = 0, scale_ld = 0;
  int row_shift = 7;
  std::vector<uint8_t> q;
  std::vector<float> scales;

  kernels::Fp8Weight weight() const {
    kernels::Fp8Weight w;
    w.q = q.data(), w.ldq = ldq, w.scales = scales.data(), w.scale_ld = scale_ld;
    w.row_shift = row_shift;
    return w;
  }
  double value(size_t r, size_t c) const {
    return e4m3_decoded(q[r * ldq + c]) *
           static_cast<double>(
               scales[(r >> row_shift) * scale_ld + c / static_cast<size_t>(kernels::kFp8BlockK)]);
  }
  /// [rows][cols] each weight rounded to float (exact with exact_scales).
  std::vector<float> widened() const {
    std::vector<float> w(rows * cols);
    for (size_t r = 0; r < rows; ++r)
      for (size_t c = 0; c < cols; ++c) w[r * cols + c] = static_cast<float>(value(r, c));
    return w;
  }
};

/// A [rows][cols] FP8 weight whose values lie within about +-3.75 * scale: bytes of exponent
/// 0 to 8 (subnormals included), scales near `scale`. exact_scales: each scale a power of two
/// (near `scale`) times 1 + j/8, so that value times scale has at most 8 significant bits (exact in
/// float and in bf16); else any float near `scale`. Rows padded to a multiple of 16 bytes.
inline Fp8Host make_fp8(std::mt19937& rng, size_t rows, size_t cols, int row_shift, float scale,
                        bool exact_scales) {
  Fp8Host h;
  h.rows = rows, h.cols = cols, h.row_shift = row_shift;
  h.ldq = (cols + 15) / 16 * 16;
  const size_t blocks = (cols + kernels::kFp8BlockK - 1) / kernels::kFp8BlockK;
  h.scale_ld = blocks + 1;
  const size_t srows = rows == 0 ? 0 : ((rows - 1) >> row_shift) + 1;
  h.q.assign(std::max<size_t>(1, rows * h.ldq), 0x7f);
  h.scales.assign(std::max<size_t>(1, srows * h.scale_ld), NAN);
  std::uniform_int_distribution<int> sign(0, 1), exp(0, 8), mant(0, 7), shift(-1, 1);
  std::uniform_real_distribution<float> any(0.5f, 2.f);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c)
      h.q[r * h.ldq + c] = static_cast<uint8_t>(sign(rng) << 7 | exp(rng) << 3 | mant(rng));
  for (size_t s = 0; s < srows; ++s)
    for (size_t b = 0; b < blocks; ++b)
      h.scales[s * h.scale_ld + b] =
          exact_scales ? std::ldexp(1 + mant(rng) / 8.f, std::ilogb(scale) + shift(rng))
                       : scale * any(rng);
  return h;
}

}  // namespace spark::test
