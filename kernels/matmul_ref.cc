#include <fmt/format.h>

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

Status matmul_check_args(const MatmulArgs& a) {
  auto bad = [](std::string m) { return make_error(Errc::usage, "matmul: " + std::move(m)); };
  if (a.n == 0 || a.k == 0) return bad(fmt::format("n {} and k {} must be > 0", a.n, a.k));
  if (a.m == 0) return Status::Ok();
  if (!a.a || !a.w || !a.out)
    return bad(fmt::format("null {} pointer", !a.a ? "a" : !a.w ? "w" : "out"));
  if (a.swiglu && a.accumulate) return bad("swiglu with accumulate is not supported");
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
  }
  return "?";
}

bool matmul_group_prefers_own(size_t m, size_t total_nk) {
  return m >= 1 && (m <= 2 || (m <= 8 && total_nk <= (size_t{32} << 20)));
}

}  // namespace spark::kernels
