#pragma once
// Host and device values for the GPU kernel tests: random inputs, values as a storage type
// holds them, device copies (poisoned ones, to catch unwritten outputs), and the bf16 error
// bounds the tests state.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cuda_runtime.h"
#include "kernels/dtype.h"
#include "support/gpu.h"

namespace spark::test::gpu {

using namespace spark::kernels;

// One bf16 ulp at |r|: 2^(e - 7) for 2^e <= |r| < 2^(e+1); the smallest normal's below.
inline double bf16_ulp(double r) {
  r = std::fabs(r);
  if (r < 0x1p-126) return 0x1p-133;
  return std::ldexp(1.0, std::ilogb(r) - 7);
}

inline std::vector<float> randoms(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& f : v) f = d(rng);
  return v;
}

// Host values as stored in `t` (bf16, e4m3: rounded) and their device bit patterns.
inline std::vector<float> as_stored(std::vector<float> v, DType t) {
  for (auto& f : v) f = round_to(t, f);
  return v;
}

struct Dev {
  kernels::DeviceMemory mem;
  size_t n = 0;
  DType t = DType::f32;
  void* get() const { return mem.get(); }
};

inline Dev to_dev(const std::vector<float>& v, DType t) {
  Dev d;
  d.n = v.size(), d.t = t;
  auto m = DeviceMemory::allocate(std::max<size_t>(1, v.size()) * dtype_size(t));
  REQUIRE_MESSAGE(m.ok(), m.error().message);
  d.mem = std::move(*m);
  if (t == DType::bf16) {
    std::vector<bf16_bits> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
    if (!b.empty()) REQUIRE(d.mem.copy_from_host(b.data(), b.size() * 2).ok());
  } else if (t == DType::e4m3) {
    std::vector<uint8_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = fp8_e4m3_code(v[i]);
    if (!b.empty()) REQUIRE(d.mem.copy_from_host(b.data(), b.size()).ok());
  } else if (!v.empty()) {
    REQUIRE(d.mem.copy_from_host(v.data(), v.size() * 4).ok());
  }
  return d;
}

inline Dev poisoned(size_t n, DType t) {
  Dev d;
  d.n = n, d.t = t;
  auto m = DeviceMemory::allocate(std::max<size_t>(1, n) * dtype_size(t));
  REQUIRE(m.ok());
  d.mem = std::move(*m);
  std::vector<uint8_t> ff(std::max<size_t>(1, n) * dtype_size(t), 0xFF);
  REQUIRE(d.mem.copy_from_host(ff.data(), ff.size()).ok());
  return d;
}

inline std::vector<float> from_dev(const Dev& d) {
  std::vector<float> v(d.n);
  if (d.t == DType::bf16) {
    std::vector<bf16_bits> b(d.n);
    REQUIRE(d.mem.copy_to_host(b.data(), b.size() * 2).ok());
    for (size_t i = 0; i < d.n; ++i) v[i] = bf16_to_float(b[i]);
  } else if (d.t == DType::e4m3) {  // poison (0xff) reads back as NaN
    std::vector<uint8_t> b(d.n);
    REQUIRE(d.mem.copy_to_host(b.data(), b.size()).ok());
    for (size_t i = 0; i < d.n; ++i) v[i] = fp8_e4m3_value(b[i]);
  } else {
    REQUIRE(d.mem.copy_to_host(v.data(), v.size() * 4).ok());
  }
  return v;
}

template <typename T>
DeviceBuf<T> ints_to_dev(const std::vector<T>& v) {
  return DeviceBuf<T>::from(v);
}

// Counts elements outside |got - ref| <= bound(i); NaN (unwritten) counts as outside.
template <typename Bound>
size_t outside(const std::vector<float>& got, const std::vector<float>& ref, Bound bound,
               double* max_err) {
  size_t bad = 0;
  *max_err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(e <= bound(i))) ++bad;
    if (std::isnan(e))
      *max_err = INFINITY;
    else
      *max_err = std::max(*max_err, e);
  }
  return bad;
}

}  // namespace spark::test::gpu
