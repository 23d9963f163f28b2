#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "kernels/matmul.h"

namespace spark::kernels {

const char* matmul_backend_name(MatmulBackend b) {
  switch (b) {
    case MatmulBackend::cublaslt:
      return "cublaslt";
    case MatmulBackend::own:
      return "own";
    default:
      return "auto";
  }
}

void matmul_ref(const float* a, const float* w, float* out, size_t m, size_t n, size_t k,
                const float* bias, bool accumulate, DType store) {
  for (size_t i = 0; i < m; ++i)
    for (size_t j = 0; j < n; ++j) {
      double acc = 0;
      for (size_t t = 0; t < k; ++t) acc += static_cast<double>(a[i * k + t]) * w[j * k + t];
      if (bias) acc += bias[j];
      if (accumulate) acc += out[i * n + j];
      out[i * n + j] = round_to(store, static_cast<float>(acc));
    }
}

void matmul_norm_ref(const float* a, const float* norm_w, float eps, const float* w, float* out,
                     size_t m, size_t n, size_t k, const float* bias, bool accumulate,
                     DType store) {
  std::vector<float> normed(k);
  for (size_t i = 0; i < m; ++i) {
    double ss = 0;
    for (size_t t = 0; t < k; ++t) ss += static_cast<double>(a[i * k + t]) * a[i * k + t];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(k) + eps);
    // The product of the unrounded normalised row, in double: one rounding to float here
    // is below the bound any caller states for the kernel, so matmul_ref's path serves.
    for (size_t t = 0; t < k; ++t)
      normed[t] = static_cast<float>(static_cast<double>(a[i * k + t]) * r * norm_w[t]);
    matmul_ref(normed.data(), w, out + i * n, 1, n, k, bias, accumulate, store);
  }
}

MatmulBackend Matmul::choose(size_t m, size_t n, size_t k) {
  // Measured on the H200 (bench/kernels, bench/results/kernel_bench-*): at 1 and 2 rows the
  // own kernel's streaming form reads every shape as fast as cuBLASLt or faster (4096 x 4096
  // 10.7 us against 13.5, 1024 x 4096 5.0 against 7.0, gate_up/down/lm_head within 1-2%, at
  // 85-98% of HBM), and it takes SwiGLU into its epilogue. From 3 to 8 rows the tensor-core
  // form wins on 1024 x 4096 (5.3 us against 7.0) and 4096 x 4096 (11.5 against 12.5); on
  // 4096 x 14336 it is within 3% alone (32.6 against 31.8) and faster in a layer's chain,
  // where it streams its weight while the kernel ahead ends (down added into the residual:
  // 134.0 us a layer against 136.2 with cuBLASLt's). cuBLASLt keeps the larger weights there
  // (gate_up without SwiGLU, lm_head), m = 32 and every prefill.
  const size_t nk = n * k;
  if (m <= 2) return MatmulBackend::own;
  if (m <= 8 && nk <= (size_t{64} << 20)) return MatmulBackend::own;
  return MatmulBackend::cublaslt;
}

Status matmul_check_args(const MatmulArgs& a) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "matmul: " + std::move(m)); };
  if (a.n == 0 || a.k == 0) return bad(fmt::format("n {} and k {} must be > 0", a.n, a.k));
  if (a.m == 0) return Status::Ok();
  if (!a.a || !a.w || !a.out)
    return bad(fmt::format("null {} pointer", !a.a ? "a" : !a.w ? "w" : "out"));
  if (a.swiglu && a.accumulate) return bad("swiglu with accumulate is not supported");
  if (a.norm_w && a.norm_unit) return bad("norm_w with norm_unit: the weight is folded or not");
  if (a.norm_w && a.m > kMatmulGemvMaxRows)
    return bad(
        fmt::format("a norm with its weight in the product takes at most {} rows (the own "
                    "kernel's streaming form), not {}; fold the weight (norm_unit) for up to {}",
                    kMatmulGemvMaxRows, a.m, kMatmulQkvRopeMaxRows));
  if (a.norm_unit && a.m > kMatmulQkvRopeMaxRows)
    return bad(fmt::format("a folded norm in the product takes at most {} rows, not {}",
                           kMatmulQkvRopeMaxRows, a.m));
  if (matmul_has_norm(a) && !(std::isfinite(a.norm_eps) && a.norm_eps >= 0))
    return bad(fmt::format("norm eps {} must be finite and >= 0", a.norm_eps));
  if (a.lda < a.k || a.ldw < a.k || a.ldo < a.n)
    return bad(fmt::format("strides lda {} ldw {} (>= k {}) and ldo {} (>= n {}) too small", a.lda,
                           a.ldw, a.k, a.ldo, a.n));
  return Status::Ok();
}

const char* own_variant_name(OwnVariant v) {
  switch (v) {
    case OwnVariant::automatic:
      return "auto";
    case OwnVariant::mma:
      return "mma";
    case OwnVariant::gemv_r1_u8:
      return "gemv r1 u8";
    case OwnVariant::gemv_r2_u4:
      return "gemv r2 u4";
    case OwnVariant::gemv_r2_u8:
      return "gemv r2 u8";
    case OwnVariant::gemv_r1_u4:
      return "gemv r1 u4";
    case OwnVariant::gemv_r2_u2:
      return "gemv r2 u2";
  }
  return "?";
}

bool matmul_group_prefers_own(size_t m, size_t total_nk) {
  return m >= 1 && (m <= 2 || (m <= 8 && total_nk <= (size_t{32} << 20)));
}

}  // namespace spark::kernels
