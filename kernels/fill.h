#pragma once
// Deterministic random fills: element i of a fill is a hash of (seed, i), uniform in
// [offset - scale, offset + scale], so a buffer filled on the GPU holds exactly what its twin
// fills on the host. For benchmarks of model shapes too large to write as a checkpoint.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// Element i's value before rounding to the buffer's type.
inline float fill_value(uint64_t seed, uint64_t i, float scale, float offset) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return offset + scale * (2.0f * u - 1.0f);
}

/// The twin: `n` values of type `t` at host `dst`.
void fill_random_ref(void* dst, DType t, size_t n, uint64_t seed, float scale, float offset);

/// The same on device memory, on `stream`.
Status fill_random_cuda_device(void* dst, DType t, size_t n, uint64_t seed, float scale,
                               float offset, void* stream);

}  // namespace spark::kernels
