#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), a
// counter-based generator: the output is a pure function of (key, counter), so the GPU
// sampler and its CPU twin draw the same numbers for the same (seed, request, step, token)
// without sharing any state. Plain C++ that nvcc compiles for the device as well.
#include <cstdint>

#if defined(__CUDACC__)
#define SPARK_HD __host__ __device__ __forceinline__
#else
#define SPARK_HD inline
#endif

namespace spark::kernels {

/// Four 32-bit words: a Philox counter or output block.
struct Philox4 {
  uint32_t v[4];
};

/// Philox4x32 with 10 rounds: the 128-bit `ctr` encrypted under the 64-bit key (k0, k1).
SPARK_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * ctr.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * ctr.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

/// The sampler's draw for one vocabulary entry: a double uniform in (0, 1) (never 0 or 1)
/// from Philox keyed by `seed`, counter (token, step, request low, request high).
SPARK_HD double philox_uniform(uint64_t seed, uint64_t request, uint32_t step, uint32_t token) {
  const Philox4 out = philox4x32_10(
      Philox4{{token, step, static_cast<uint32_t>(request), static_cast<uint32_t>(request >> 32)}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  // 53 random bits, offset by half a step so the value is strictly inside (0, 1).
  const uint64_t bits = (static_cast<uint64_t>(out.v[0]) << 21) ^ (out.v[1] >> 11);
  return (static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) + 0.5) * 0x1p-53;
}

}  // namespace spark::kernels
