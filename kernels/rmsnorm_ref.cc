#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/rmsnorm.h"

namespace spark::kernels {

void rmsnorm_ref(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps) {
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0;
    for (size_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (size_t i = 0; i < dim; ++i) yr[i] = static_cast<float>(xr[i] * inv * w[i]);
  }
}

void rmsnorm_bf16_ref(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows, size_t dim,
                      float eps) {
  std::vector<float> wf(dim), xf(dim), yf(dim);
  for (size_t i = 0; i < dim; ++i) wf[i] = bf16_to_float(w[i]);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < dim; ++i) xf[i] = bf16_to_float(x[r * dim + i]);
    rmsnorm_ref(xf.data(), wf.data(), yf.data(), 1, dim, eps);
    for (size_t i = 0; i < dim; ++i) y[r * dim + i] = float_to_bf16(yf[i]);
  }
}

void add_rmsnorm_ref(float* hidden, const float* delta, const float* w, float* out, size_t rows,
                     size_t dim, float eps, DType store) {
  for (size_t r = 0; r < rows; ++r) {
    float* h = hidden + r * dim;
    if (delta)
      for (size_t i = 0; i < dim; ++i) h[i] = round_to(store, h[i] + delta[r * dim + i]);
    rmsnorm_ref(h, w, out + r * dim, 1, dim, eps);
    for (size_t i = 0; i < dim; ++i) out[r * dim + i] = round_to(store, out[r * dim + i]);
  }
}

void head_rmsnorm_ref(float* x, size_t token_stride, size_t n_tokens, int n_heads, int head_dim,
                      const float* w, float eps, DType store) {
  const size_t hd = static_cast<size_t>(head_dim);
  for (size_t t = 0; t < n_tokens; ++t)
    for (size_t h = 0; h < static_cast<size_t>(n_heads); ++h) {
      float* v = x + t * token_stride + h * hd;
      rmsnorm_ref(v, w, v, 1, hd, eps);
      for (size_t i = 0; i < hd; ++i) v[i] = round_to(store, v[i]);
    }
}

Status rmsnorm_check_args(const void* x, const void* w, const void* y, size_t rows, size_t dim,
                          float eps, size_t elem_size) {
  if (dim == 0) return make_error(Errc::usage, "rmsnorm: dim must be > 0");
  if (!std::isfinite(eps) || eps < 0)
    return make_error(Errc::usage,
                      fmt::format("rmsnorm: eps must be finite and >= 0, got {}", eps));
  if (rows > 0 && (!x || !w || !y))
    return make_error(Errc::usage, fmt::format("rmsnorm: null {} pointer", !x   ? "input"
                                                                           : !w ? "weight"
                                                                                : "output"));
  if (rows > std::numeric_limits<size_t>::max() / dim / elem_size)
    return make_error(
        Errc::resource,
        fmt::format("rmsnorm: {} rows x {} elements overflow the address space", rows, dim));
  return Status::Ok();
}

void rmsnorm_fold_weight_ref(bf16_bits* w, size_t rows, size_t cols, const bf16_bits* norm_w) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) {
      bf16_bits& v = w[r * cols + c];
      v = float_to_bf16(bf16_to_float(v) * bf16_to_float(norm_w[c]));
    }
}

}  // namespace spark::kernels
