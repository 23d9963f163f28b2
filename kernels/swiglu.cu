// SwiGLU on the GPU: an elementwise grid-stride loop over rows*dim outputs; each thread reads
// its gate and up values from the fused [gate | up] row and writes silu(gate) * up.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda_check.cuh"
#include "kernels/cuda_runtime.h"
#include "kernels/device_common.cuh"
#include "kernels/swiglu.h"

namespace spark::kernels {
namespace {

__device__ __forceinline__ float load_f32(float v) {
  return v;
}
__device__ __forceinline__ float load_f32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ void store_f32(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void store_f32(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}

template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gate_up, T* __restrict__ y, size_t rows,
                              size_t dim) {
  dev::pdl_wait();  // programmatic launch: the kernel ahead has finished
  dev::pdl_trigger();

  const size_t n = rows * dim;
  for (size_t k = blockIdx.x * size_t{blockDim.x} + threadIdx.x; k < n;
       k += size_t{gridDim.x} * blockDim.x) {
    const size_t r = k / dim, i = k - r * dim;
    const float g = load_f32(gate_up[r * 2 * dim + i]);
    const float u = load_f32(gate_up[r * 2 * dim + dim + i]);
    store_f32(&y[k], g / (1.f + expf(-g)) * u);
  }
}

template <typename T>
Status launch(const T* gate_up, T* y, size_t rows, size_t dim, cudaStream_t stream) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(T)));
  if (rows == 0) return Status::Ok();
  constexpr unsigned kThreads = 256;
  const size_t n = rows * dim;
  const unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 1u << 20));
  SPARK_CUDA_TRY(dev::launch(swiglu_kernel<T>, dim3(blocks), dim3(kThreads), 0, stream, gate_up, y,
                             rows, dim));
  SPARK_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

template <typename T, typename Dev>
Status run_on_host_arrays(const T* gate_up, T* y, size_t rows, size_t dim) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(T)));
  if (rows == 0) return Status::Ok();
  SPARK_TRY(cuda_device_count().status());
  const size_t in_bytes = rows * 2 * dim * sizeof(T), out_bytes = rows * dim * sizeof(T);
  auto din = DeviceMemory::allocate(in_bytes);
  SPARK_TRY(din.status());
  auto dout = DeviceMemory::allocate(out_bytes);
  SPARK_TRY(dout.status());
  SPARK_TRY(din->copy_from_host(gate_up, in_bytes));
  SPARK_TRY(launch(static_cast<const Dev*>(din->get()), static_cast<Dev*>(dout->get()), rows, dim,
                   nullptr));
  SPARK_CUDA_TRY(cudaDeviceSynchronize());
  SPARK_TRY(dout->copy_to_host(y, out_bytes));
  return Status::Ok();
}

}  // namespace

Status swiglu_cuda(const float* gate_up_host, float* y_host, size_t rows, size_t dim) {
  return run_on_host_arrays<float, float>(gate_up_host, y_host, rows, dim);
}

Status swiglu_bf16_cuda(const bf16_bits* gate_up_host, bf16_bits* y_host, size_t rows, size_t dim) {
  return run_on_host_arrays<bf16_bits, __nv_bfloat16>(gate_up_host, y_host, rows, dim);
}

Status swiglu_cuda_device(const float* gate_up_dev, float* y_dev, size_t rows, size_t dim,
                          void* stream) {
  return launch(gate_up_dev, y_dev, rows, dim, static_cast<cudaStream_t>(stream));
}

Status swiglu_bf16_cuda_device(const bf16_bits* gate_up_dev, bf16_bits* y_dev, size_t rows,
                               size_t dim, void* stream) {
  return launch(reinterpret_cast<const __nv_bfloat16*>(gate_up_dev),
                reinterpret_cast<__nv_bfloat16*>(y_dev), rows, dim,
                static_cast<cudaStream_t>(stream));
}

}  // namespace spark::kernels
