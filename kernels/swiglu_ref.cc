#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/swiglu.h"

namespace spark::kernels {

void swiglu_ref(const float* gate_up, float* y, size_t rows, size_t dim) {
  for (size_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * dim;
    const float* up = gate + dim;
    for (size_t i = 0; i < dim; ++i) {
      double g = gate[i];
      y[r * dim + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
    }
  }
}

void swiglu_bf16_ref(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim) {
  std::vector<float> in(2 * dim), out(dim);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < 2 * dim; ++i) in[i] = bf16_to_float(gate_up[r * 2 * dim + i]);
    swiglu_ref(in.data(), out.data(), 1, dim);
    for (size_t i = 0; i < dim; ++i) y[r * dim + i] = float_to_bf16(out[i]);
  }
}

Status swiglu_check_args(const void* gate_up, const void* y, size_t rows, size_t dim,
                         size_t elem_size) {
  if (dim == 0) return make_error(Errc::usage, "swiglu: dim must be > 0");
  if (rows > 0 && (!gate_up || !y))
    return make_error(Errc::usage,
                      fmt::format("swiglu: null {} pointer", !gate_up ? "input" : "output"));
  if (rows > std::numeric_limits<size_t>::max() / 2 / dim / elem_size)
    return make_error(
        Errc::resource,
        fmt::format("swiglu: {} rows x {} elements overflow the address space", rows, dim));
  return Status::Ok();
}

}  // namespace spark::kernels
