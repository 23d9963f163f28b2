// RMSNorm: the reference twin against hand-computed values (runs everywhere), and the CUDA
// kernel against the reference on seeded inputs (skips with a printed reason without a GPU).
#include "kernels/rmsnorm.h"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "support/gpu.h"

using namespace spark;
using namespace spark::kernels;

TEST_CASE("rmsnorm_ref matches hand-computed rows") {
  // Row 0: rms(3,4) = sqrt(12.5); row 1: all ones -> y == w; row 2: eps dominates.
  const std::vector<float> x = {3, 4, 1, 1, 1, -1};
  SUBCASE("unit weights, eps 0") {
    std::vector<float> y(4);
    const std::vector<float> w = {1, 1};
    rmsnorm_ref(x.data(), w.data(), y.data(), 2, 2, 0.f);
    CHECK(y[0] == doctest::Approx(3 / std::sqrt(12.5)).epsilon(1e-7));
    CHECK(y[1] == doctest::Approx(4 / std::sqrt(12.5)).epsilon(1e-7));
    CHECK(y[2] == doctest::Approx(1.0));
    CHECK(y[3] == doctest::Approx(1.0));
  }
  SUBCASE("weights scale each column, eps enters under the root") {
    std::vector<float> y(6);
    const std::vector<float> w = {2, 0.5f};
    rmsnorm_ref(x.data(), w.data(), y.data(), 3, 2, 1.f);
    // Row 2: mean(x^2) = 1, so 1/sqrt(1 + 1).
    CHECK(y[4] == doctest::Approx(2 / std::sqrt(2.0)).epsilon(1e-7));
    CHECK(y[5] == doctest::Approx(-0.5 / std::sqrt(2.0)).epsilon(1e-7));
    CHECK(y[2] == doctest::Approx(2 / std::sqrt(2.0)).epsilon(1e-7));
    CHECK(y[0] == doctest::Approx(6 / std::sqrt(13.5)).epsilon(1e-7));
  }
  SUBCASE("a zero row with eps > 0 stays zero") {
    const std::vector<float> z = {0, 0, 0}, w = {1, 1, 1};
    std::vector<float> y(3, 7.f);
    rmsnorm_ref(z.data(), w.data(), y.data(), 1, 3, 1e-6f);
    CHECK(y == std::vector<float>{0, 0, 0});
  }
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN") {
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(-2.0f) == 0xC000);
  CHECK(float_to_bf16(1.0f + 0x1p-8f) == 0x3F80);      // tie -> even (down)
  CHECK(float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3F82);  // tie -> even (up)
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-16f) == 0x3F81);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(bf16_to_float(0x3FC0) == 1.5f);
}

TEST_CASE("rmsnorm_bf16_ref rounds the float result to bfloat16") {
  const std::vector<bf16_bits> x = {float_to_bf16(3), float_to_bf16(4)};
  const std::vector<bf16_bits> w = {float_to_bf16(1), float_to_bf16(2)};
  std::vector<bf16_bits> y(2);
  rmsnorm_bf16_ref(x.data(), w.data(), y.data(), 1, 2, 0.f);
  CHECK(y[0] == float_to_bf16(static_cast<float>(3 / std::sqrt(12.5))));
  CHECK(y[1] == float_to_bf16(static_cast<float>(8 / std::sqrt(12.5))));
  CHECK(bf16_to_float(y[1]) == doctest::Approx(8 / std::sqrt(12.5)).epsilon(1.0 / 128));
}

TEST_CASE("rmsnorm argument checks name the bad argument") {
  float a = 1;
  CHECK(rmsnorm_check_args(&a, &a, &a, 1, 1, 1e-6f, 4).ok());
  CHECK(rmsnorm_check_args(nullptr, nullptr, nullptr, 0, 8, 1e-6f, 4).ok());
  auto s = rmsnorm_check_args(&a, &a, &a, 1, 0, 1e-6f, 4);
  CHECK(s.code() == Errc::usage);
  CHECK(s.message().find("dim") != std::string::npos);
  CHECK(rmsnorm_check_args(&a, &a, &a, 1, 1, -1.f, 4).message().find("eps") != std::string::npos);
  CHECK(rmsnorm_check_args(&a, &a, &a, 1, 1, NAN, 4).code() == Errc::usage);
  CHECK(rmsnorm_check_args(&a, nullptr, &a, 1, 1, 0.f, 4).message().find("weight") !=
        std::string::npos);
  CHECK(rmsnorm_check_args(&a, &a, &a, std::numeric_limits<size_t>::max() / 2, 4, 0.f, 4).code() ==
        Errc::resource);
  // The CUDA entry points check before touching the GPU, with or without one.
  CHECK(rmsnorm_cuda(&a, &a, &a, 1, 0, 0.f).code() == Errc::usage);
}

TEST_CASE("without a usable GPU the CUDA path fails cleanly and says why") {
  std::string why = test::cuda_skip_reason();
  if (why.empty()) {
    MESSAGE("a CUDA device is present; the no-device path is not exercised here");
    return;
  }
  float x = 1, w = 1, y = 0;
  auto s = rmsnorm_cuda(&x, &w, &y, 1, 1, 0.f);
  CHECK(s.code() == Errc::unsupported);
  CHECK(s.message().find(built_with_cuda() ? "no CUDA device" : "built without CUDA") !=
        std::string::npos);
  CHECK(y == 0);
}

namespace {

struct Shape {
  size_t rows, dim;
};
// One-warp rows, ragged tails, several passes per thread (dim > 512 threads), a long row.
const Shape kShapes[] = {{1, 1},     {1, 7},    {3, 32},    {5, 100},   {17, 1000},
                         {64, 4096}, {2, 8195}, {3, 20000}, {1000, 64}, {4, 128}};

}  // namespace

TEST_CASE("rmsnorm_cuda matches rmsnorm_ref on seeded inputs (max abs diff <= 1e-5)") {
  if (test::skip_without_cuda()) return;
  // Inputs in [-2, 2), weights in [0.5, 1.5): |y| < 6, fp32 accumulation with rsqrtf keeps
  // the error to a few ulp of y; 1e-5 absolute is a bound with margin, not a tuned value.
  for (const auto& sh : kShapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.dim);
    auto x = test::seeded_floats(sh.rows * sh.dim, 1234u + static_cast<uint32_t>(sh.dim), -2, 2);
    auto w = test::seeded_floats(sh.dim, 99u, 0.5f, 1.5f);
    std::vector<float> ref(x.size()), got(x.size(), NAN);
    rmsnorm_ref(x.data(), w.data(), ref.data(), sh.rows, sh.dim, 1e-6f);
    auto s = rmsnorm_cuda(x.data(), w.data(), got.data(), sh.rows, sh.dim, 1e-6f);
    REQUIRE_MESSAGE(s.ok(), s.message());
    double max_diff = 0;
    size_t wrong = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
      if (!(d <= 1e-5)) ++wrong;
      if (d > max_diff || std::isnan(d)) max_diff = std::isnan(d) ? INFINITY : d;
    }
    CAPTURE(max_diff);
    CHECK(wrong == 0);
  }
}

TEST_CASE("rmsnorm_bf16_cuda is within one bfloat16 ulp of the reference") {
  if (test::skip_without_cuda()) return;
  for (const auto& sh : kShapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.dim);
    auto xf = test::seeded_floats(sh.rows * sh.dim, 77u + static_cast<uint32_t>(sh.rows), -4, 4);
    auto wf = test::seeded_floats(sh.dim, 5u, 0.25f, 2.f);
    std::vector<bf16_bits> x(xf.size()), w(wf.size()), ref(x.size()), got(x.size(), 0x7FC0);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float_to_bf16(xf[i]);
    for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(wf[i]);
    rmsnorm_bf16_ref(x.data(), w.data(), ref.data(), sh.rows, sh.dim, 1e-5f);
    auto s = rmsnorm_bf16_cuda(x.data(), w.data(), got.data(), sh.rows, sh.dim, 1e-5f);
    REQUIRE_MESSAGE(s.ok(), s.message());
    size_t wrong = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      double r = bf16_to_float(ref[i]), g = bf16_to_float(got[i]);
      // One ulp of a bfloat16 near r is |r| * 2^-7 (rounded up to the binade's ulp).
      if (!(std::fabs(g - r) <= std::fabs(r) * 0x1p-7 + 1e-30)) ++wrong;
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("rmsnorm_cuda_device runs on device pointers and strides past the grid limit") {
  if (test::skip_without_cuda()) return;
  // 2^20 + 3 rows: more rows than blocks launched, so the row stride loop is exercised.
  const size_t rows = (size_t{1} << 20) + 3, dim = 8;
  auto x = test::seeded_floats(rows * dim, 7u, -1, 1);
  auto w = test::seeded_floats(dim, 8u, 0.5f, 1.5f);
  std::vector<float> ref(x.size()), got(x.size(), NAN);
  rmsnorm_ref(x.data(), w.data(), ref.data(), rows, dim, 1e-6f);
  auto dx = DeviceMemory::allocate(x.size() * 4), dw = DeviceMemory::allocate(dim * 4),
       dy = DeviceMemory::allocate(x.size() * 4);
  REQUIRE(dx.ok());
  REQUIRE(dw.ok());
  REQUIRE(dy.ok());
  REQUIRE(dx->copy_from_host(x.data(), x.size() * 4).ok());
  REQUIRE(dw->copy_from_host(w.data(), dim * 4).ok());
  auto s = rmsnorm_cuda_device(static_cast<const float*>(dx->get()),
                               static_cast<const float*>(dw->get()), static_cast<float*>(dy->get()),
                               rows, dim, 1e-6f, nullptr);
  REQUIRE_MESSAGE(s.ok(), s.message());
  REQUIRE(cuda_synchronize().ok());
  REQUIRE(dy->copy_to_host(got.data(), got.size() * 4).ok());
  size_t wrong = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (!(std::fabs(got[i] - ref[i]) <= 1e-5)) ++wrong;
  CHECK(wrong == 0);
}

TEST_CASE("a CUDA failure names the call, file:line and CUDA's error string") {
  if (test::skip_without_cuda()) return;
  auto m = DeviceMemory::allocate(size_t{1} << 52);  // 4 PiB: no GPU has it
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code == Errc::resource);
  CHECK(m.error().message.find("kernels/cuda_runtime.cu:") != std::string::npos);
  CHECK(m.error().message.find("cudaMalloc") != std::string::npos);
  CHECK(m.error().message.find("cudaErrorMemoryAllocation") != std::string::npos);
  // The failed allocation is not sticky: the device still works.
  float x = 2, w = 1, y = 0;
  REQUIRE(rmsnorm_cuda(&x, &w, &y, 1, 1, 0.f).ok());
  CHECK(y == doctest::Approx(1.0));
}
