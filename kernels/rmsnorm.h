#pragma once
// RMSNorm: y[r][i] = x[r][i] / sqrt(mean_i(x[r]^2) + eps) * w[i], row by row.
// rmsnorm_ref is the plain C++ reference twin (and the CPU path) of the CUDA kernel in
// rmsnorm.cu. The CUDA entry points need no CUDA headers in the caller; in a build without
// CUDA they return Errc::unsupported ("built without CUDA").
#include <cstddef>

#include "core/error.h"
#include "kernels/bf16.h"

namespace spark::kernels {

/// Reference RMSNorm over `rows` rows of `dim` floats; accumulates in double.
void rmsnorm_ref(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps);

/// Reference BF16 RMSNorm: widens to float, normalises as rmsnorm_ref, rounds the result
/// to the nearest bfloat16.
void rmsnorm_bf16_ref(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows, size_t dim,
                      float eps);

/// Checks the arguments every RMSNorm entry point takes (non-null pointers when rows > 0,
/// dim > 0, finite eps >= 0, sizes that fit in memory); names the bad one.
Status rmsnorm_check_args(const void* x, const void* w, const void* y, size_t rows, size_t dim,
                          float eps, size_t elem_size);

/// RMSNorm on the GPU for host arrays: allocates device memory, copies in, launches one
/// block per row, copies out and synchronises. fp32 accumulation.
Status rmsnorm_cuda(const float* x_host, const float* w_host, float* y_host, size_t rows,
                    size_t dim, float eps);

/// The same for bfloat16 host arrays (fp32 accumulation, output rounded to bfloat16).
Status rmsnorm_bf16_cuda(const bf16_bits* x_host, const bf16_bits* w_host, bf16_bits* y_host,
                         size_t rows, size_t dim, float eps);

/// RMSNorm on device pointers, enqueued on `stream` (a cudaStream_t; nullptr = the default
/// stream). Returns after the launch; errors of the launch itself are reported, errors
/// during execution surface at the caller's next synchronisation.
Status rmsnorm_cuda_device(const float* x_dev, const float* w_dev, float* y_dev, size_t rows,
                           size_t dim, float eps, void* stream);

/// BF16 variant of rmsnorm_cuda_device (pointers to __nv_bfloat16).
Status rmsnorm_bf16_cuda_device(const bf16_bits* x_dev, const bf16_bits* w_dev, bf16_bits* y_dev,
                                size_t rows, size_t dim, float eps, void* stream);

}  // namespace spark::kernels
