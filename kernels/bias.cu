// Bias add on the GPU: a grid-stride loop over rows*dim elements, fp32 add, one rounding.
#include <algorithm>

#include "kernels/bias.h"
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"

namespace spark::kernels {
namespace {

template <typename T>
__global__ void bias_kernel(T* __restrict__ x, const T* __restrict__ b, size_t rows, size_t dim) {
  const size_t n = rows * dim;
  for (size_t k = blockIdx.x * size_t{blockDim.x} + threadIdx.x; k < n;
       k += size_t{gridDim.x} * blockDim.x)
    x[k] = dev::from_f<T>(dev::to_f(x[k]) + dev::to_f(b[k % dim]));
}

}  // namespace

Status bias_add_cuda_device(DType dt, void* x, const void* bias, size_t rows, size_t dim,
                            void* stream) {
  if (dim == 0) return make_error(Errc::usage, "bias_add: dim must be > 0");
  if (rows == 0) return Status::Ok();
  if (!x || !bias)
    return make_error(Errc::usage,
                      std::string("bias_add: null ") + (!x ? "x" : "bias") + " pointer");
  const size_t n = rows * dim;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1u << 16));
  SPARK_DISPATCH_DTYPE(dt, T,
                       bias_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
                           static_cast<T*>(x), static_cast<const T*>(bias), rows, dim));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace spark::kernels
