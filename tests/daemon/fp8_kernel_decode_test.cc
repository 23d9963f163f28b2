// The FP8 kernels' e4m3 decoder (kernels/fp8.h) against the checkpoint loader's: the
// products over stored weights and the loader's widening must read every code the same.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "daemon/engine/weight_format.h"
#include "kernels/fp8.h"

TEST_CASE("fp8 kernels: fp8_e4m3_value equals the loader's decoder for all 256 codes") {
  for (int c = 0; c < 256; ++c) {
    CAPTURE(c);
    const float k = spark::kernels::fp8_e4m3_value(static_cast<uint8_t>(c));
    const float e = spark::engine::fp8_e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(e)) {
      CHECK(std::isnan(k));
      continue;
    }
    uint32_t kb, eb;  // bit for bit: -0 is not +0
    std::memcpy(&kb, &k, 4);
    std::memcpy(&eb, &e, 4);
    CHECK(kb == eb);
  }
}
