#pragma once
// Bias add: x[r][i] += bias[i] over `rows` rows of `dim` (Qwen2's q/k/v projections).
// bias_add_ref is the CPU twin of bias.cu. The matrix products can also add a bias in
// their epilogue (matmul.h); this is the standalone op.
#include <cstddef>

#include "core/error.h"
#include "kernels/dtype.h"

namespace spark::kernels {

/// Reference bias add in place; `store` is the type x is kept in (its sum is rounded to it).
void bias_add_ref(float* x, const float* bias, size_t rows, size_t dim, DType store);

/// In-place bias add on device pointers; x and bias are both of type `dt`.
Status bias_add_cuda_device(DType dt, void* x, const void* bias, size_t rows, size_t dim,
                            void* stream);

}  // namespace spark::kernels
