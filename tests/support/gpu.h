#pragma once
// GPU test helpers: skip (with a printed reason) where no CUDA device can be used, and
// seeded inputs shared by the kernel tests.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

/// A seed for fresh random test inputs: SPARK_TEST_SEED when set (to replay a failure),
/// else a new one per call. Printed, so a failing run can be repeated.
inline uint32_t fresh_seed(const char* what) {
  uint32_t seed;
  const char* fixed = std::getenv("SPARK_TEST_SEED");
  if (fixed && *fixed)
    seed = static_cast<uint32_t>(std::strtoul(fixed, nullptr, 10));
  else
    seed = std::random_device{}();
  MESSAGE(std::string(what) << ": SPARK_TEST_SEED=" << seed);
  return seed;
}

/// Device buffer of `n` elements of T, filled from a host vector or poisoned with 0xFF
/// bytes (NaN for float and bfloat16), so an element the kernel did not write fails any
/// bound. Fails the test when allocation or a copy fails.
template <typename T>
struct DeviceBuf {
  kernels::DeviceMemory mem;
  size_t n = 0;
  static DeviceBuf from(const std::vector<T>& v) {
    DeviceBuf b;
    b.n = v.size();
    auto m = kernels::DeviceMemory::allocate(std::max<size_t>(1, v.size()) * sizeof(T));
    REQUIRE_MESSAGE(m.ok(), m.error().message);
    b.mem = std::move(*m);
    if (!v.empty()) REQUIRE(b.mem.copy_from_host(v.data(), v.size() * sizeof(T)).ok());
    return b;
  }
  static DeviceBuf poisoned(size_t n) { return from(std::vector<T>(n, poison())); }
  static T poison() {
    T t;
    std::memset(static_cast<void*>(&t), 0xFF, sizeof t);
    return t;
  }
  T* get() const { return static_cast<T*>(mem.get()); }
  std::vector<T> host() const {
    std::vector<T> v(n);
    if (n) REQUIRE(mem.copy_to_host(v.data(), n * sizeof(T)).ok());
    return v;
  }
};

}  // namespace spark::test
