#pragma once
// For .cu files only: turn a cudaError_t into a Status whose message names the call, the
// source file:line and CUDA's own error name and string.
#include <cuda_runtime.h>

#include "core/error.h"

namespace spark::kernels::detail {

/// Error kind for a CUDA error: no device/driver -> unsupported, out of memory -> resource,
/// anything else -> internal.
Errc errc_for_cuda(cudaError_t e);

/// "kernels/rmsnorm.cu:42: cudaMalloc(...) failed: cudaErrorMemoryAllocation: out of memory".
Error cuda_error(cudaError_t e, const char* expr, const char* file, int line);

}  // namespace spark::kernels::detail

/// Returns a Status from the enclosing function when `expr` (a CUDA runtime call) fails.
/// A failed call also leaves its error as the thread's "last error"; it is read off here so
/// that a later launch check (cudaGetLastError) does not report this old, non-sticky error
/// (seen on the H200: a refused cudaMalloc made the next kernel launch look failed).
#define SPARK_CUDA_TRY(expr)                                                                 \
  do {                                                                                       \
    cudaError_t spark_cuda_err_ = (expr);                                                    \
    if (spark_cuda_err_ != cudaSuccess) {                                                    \
      (void)cudaGetLastError();                                                              \
      return ::spark::kernels::detail::cuda_error(spark_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)
