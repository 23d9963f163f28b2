// SwiGLU: the reference twin against hand-computed values (runs everywhere), and the CUDA
// kernel against the reference on seeded inputs (skips with a printed reason without a GPU).
#include "kernels/swiglu.h"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "support/gpu.h"

using namespace spark;
using namespace spark::kernels;

TEST_CASE("swiglu_ref matches hand-computed values on the fused [gate | up] layout") {
  // Two rows of dim 3: gates then ups.
  const std::vector<float> gu = {0, 1,    -1, /*up*/ 5, 2, 3,  //
                                 4, -100, 2,  /*up*/ 1, 1, -0.5f};
  std::vector<float> y(6, NAN);
  swiglu_ref(gu.data(), y.data(), 2, 3);
  const double s1 = 1 / (1 + std::exp(-1.0)), sm1 = -1 / (1 + std::exp(1.0));
  CHECK(y[0] == 0.f);
  CHECK(y[1] == doctest::Approx(2 * s1).epsilon(1e-7));   // 1.4621171...
  CHECK(y[2] == doctest::Approx(3 * sm1).epsilon(1e-7));  // -0.8068242...
  CHECK(y[3] == doctest::Approx(4 / (1 + std::exp(-4.0))).epsilon(1e-7));
  CHECK(std::fabs(y[4]) < 1e-30);  // silu(-100) underflows to (almost) zero
  CHECK(y[5] == doctest::Approx(-0.5 * 2 / (1 + std::exp(-2.0))).epsilon(1e-7));
}

TEST_CASE("swiglu argument checks") {
  float a = 0;
  CHECK(swiglu_check_args(&a, &a, 1, 1, 4).ok());
  CHECK(swiglu_check_args(&a, &a, 1, 0, 4).code() == Errc::usage);
  CHECK(swiglu_check_args(nullptr, &a, 1, 1, 4).message().find("input") != std::string::npos);
  CHECK(swiglu_cuda(&a, nullptr, 1, 1).code() == Errc::usage);
}

TEST_CASE("swiglu_cuda matches swiglu_ref on seeded inputs (|diff| <= 1e-6 * (1 + |ref|))") {
  if (test::skip_without_cuda()) return;
  // expf is within 2 ulp and the rest is three float operations: a relative bound of 1e-6
  // (about 8 ulp) holds with margin for gates in [-10, 10).
  struct Shape {
    size_t rows, dim;
  } shapes[] = {{1, 1}, {3, 5}, {7, 1000}, {64, 14336}, {1, 300001}};
  for (const auto& sh : shapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.dim);
    auto gu =
        test::seeded_floats(sh.rows * 2 * sh.dim, 31u + static_cast<uint32_t>(sh.dim), -10, 10);
    std::vector<float> ref(sh.rows * sh.dim), got(ref.size(), NAN);
    swiglu_ref(gu.data(), ref.data(), sh.rows, sh.dim);
    auto s = swiglu_cuda(gu.data(), got.data(), sh.rows, sh.dim);
    REQUIRE_MESSAGE(s.ok(), s.message());
    size_t wrong = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      if (!(std::fabs(got[i] - ref[i]) <= 1e-6 * (1 + std::fabs(ref[i])))) ++wrong;
    CHECK(wrong == 0);
  }
}

TEST_CASE("swiglu_bf16_cuda is within one bfloat16 ulp of the reference") {
  if (test::skip_without_cuda()) return;
  const size_t rows = 33, dim = 4099;
  auto f = test::seeded_floats(rows * 2 * dim, 3u, -6, 6);
  std::vector<bf16_bits> gu(f.size()), ref(rows * dim), got(rows * dim, 0x7FC0);
  for (size_t i = 0; i < f.size(); ++i) gu[i] = float_to_bf16(f[i]);
  swiglu_bf16_ref(gu.data(), ref.data(), rows, dim);
  auto s = swiglu_bf16_cuda(gu.data(), got.data(), rows, dim);
  REQUIRE_MESSAGE(s.ok(), s.message());
  size_t wrong = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double r = bf16_to_float(ref[i]), g = bf16_to_float(got[i]);
    if (!(std::fabs(g - r) <= std::fabs(r) * 0x1p-7 + 1e-30)) ++wrong;
  }
  CHECK(wrong == 0);
}
