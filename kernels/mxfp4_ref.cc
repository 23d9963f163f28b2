// MXFP4 weights on the host: the exact widening (the twin of the kernels' in-register and
// tile widening) and the argument check the expert kernels share.
#include <fmt/format.h>

#include <cstdint>

#include "kernels/mxfp4.h"

namespace spark::kernels {

void mxfp4_widen_ref(const Mxfp4Weight& w, size_t row0, size_t rows, size_t k, float* out,
                     size_t ldo) {
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* b = w.blocks + (row0 + r) * w.ldb;
    const uint8_t* s = w.scales + (row0 + r) * w.lds;
    for (size_t c = 0; c < k; ++c) {
      const uint8_t byte = b[c / 2];
      const uint8_t code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
      // Two significant bits times a power of two: exact in float within its range.
      out[r * ldo + c] = static_cast<float>(static_cast<double>(mxfp4_e2m1_value(code)) *
                                            mxfp4_scale_value(s[c / kMxfp4BlockK]));
    }
  }
}

Status mxfp4_weight_check(const Mxfp4Weight& w, size_t k, const char* name) {
  auto bad = [&](const std::string& m) {
    return make_error(Errc::usage, fmt::format("{}: {}", name, m));
  };
  if (!w.blocks || !w.scales) return bad("null blocks or scales");
  if (k % kMxfp4BlockK != 0)
    return bad(fmt::format("{} columns: MXFP4 needs a multiple of {}", k, kMxfp4BlockK));
  if (w.ldb < k / 2)
    return bad(fmt::format("ldb {} is less than {} columns' {} bytes", w.ldb, k, k / 2));
  if (w.lds < k / kMxfp4BlockK)
    return bad(
        fmt::format("lds {} is less than {} columns' {} scales", w.lds, k, k / kMxfp4BlockK));
  if (w.ldb % 16 != 0 || reinterpret_cast<uintptr_t>(w.blocks) % 16 != 0)
    return bad(fmt::format("blocks and ldb ({}) must be multiples of 16 bytes", w.ldb));
  return Status::Ok();
}

}  // namespace spark::kernels
