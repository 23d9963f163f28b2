#pragma once
// For .cu files only: turn a cudaError_t into a Status whose message names the call, the
// source file:line and CUDA's own error name and string.
#include <cuda_runtime.h>

#include "core/error.h"
#include "kernels/cuda_runtime.h"

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
#define SPARK_CUDA_TRY(expr)                                                                   \
  do {                                                                                         \
    cudaError_t spark_cuda_err_ = (expr);                                                      \
    if (spark_cuda_err_ != cudaSuccess) {                                                      \
      (void)cudaGetLastError();                                                                \
      return ::spark::kernels::detail::cuda_error(spark_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                          \
  } while (0)

namespace spark::kernels::detail {

/// Checks a launch of `kernel` against the device's limits and, past the default 48 KiB of
/// dynamic shared memory, raises the kernel's limit to `smem` (once per size asked).
template <typename Kernel>
Status prepare_launch(Kernel* kernel, const char* name, unsigned threads, size_t smem) {
  Status s = cuda_check_launch(name, threads, smem);
  if (!s.ok()) return s;
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_error(e, name, __FILE__, __LINE__);
    }
  }
  return Status::Ok();
}

}  // namespace spark::kernels::detail

/// Returns the launch error (if any) of the kernel launched just before, naming it.
#define SPARK_CUDA_LAUNCHED(name) SPARK_CUDA_TRY(cudaGetLastError())
