#pragma once
// RMSNorm: y[r][i] = x[r][i] / sqrt(mean_i(x[r]^2) + eps) * w[i], row by row.
// rmsnorm_ref is the plain C++ reference twin (and the CPU path) of the CUDA kernel.
#include <cstddef>

namespace spark::kernels {

/// Reference RMSNorm over `rows` rows of `dim` floats; accumulates in double.
void rmsnorm_ref(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps);

}  // namespace spark::kernels
