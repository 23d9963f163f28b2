#pragma once
// GPU test helpers: skip (with a printed reason) where no CUDA device can be used, and
// seeded inputs shared by the kernel tests.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_runtime.h"

namespace spark::test {

/// Empty when a CUDA device is usable, else the reason to skip ("no CUDA device: ...").
inline std::string cuda_skip_reason() {
  auto n = kernels::cuda_device_count();
  return n.ok() ? std::string() : n.error().message;
}

/// Prints "SKIP: <reason>" (stdout and doctest MESSAGE) and returns true when no CUDA
/// device is usable; use as `if (skip_without_cuda()) return;`. With SPARK_REQUIRE_GPU=1
/// (set by the GPU machine's run script) a missing device fails the test instead, so a
/// broken driver setup cannot pass as a row of skips.
inline bool skip_without_cuda() {
  std::string why = cuda_skip_reason();
  if (why.empty()) return false;
  const char* require = std::getenv("SPARK_REQUIRE_GPU");
  if (require && std::string(require) == "1") {
    FAIL_CHECK("SPARK_REQUIRE_GPU=1 but " << why);
    return true;
  }
  std::cout << "SKIP: " << why << "\n";
  MESSAGE("SKIP: " << why);
  return true;
}

/// `n` floats uniform in [lo, hi) from a fixed seed.
inline std::vector<float> seeded_floats(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& f : v) f = d(rng);
  return v;
}

}  // namespace spark::test
