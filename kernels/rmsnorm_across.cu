// The two halves of a norm whose row the tensor-parallel ranks hold in parts: each rank's
// sums of squares (one block a row), and after their all-reduce the scaling of its part.
#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/rmsnorm.h"

namespace spark::kernels {
namespace {

__global__ void row_sumsq_kernel(const dev::bf16* x, size_t dim, float* ss) {
  dev::pdl_wait();
  dev::pdl_trigger();
  __shared__ float scratch[33];
  const dev::bf16* row = x + blockIdx.x * dim;
  float s = 0.f;
  for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = __bfloat162float(row[i]);
    s = fmaf(v, v, s);
  }
  s = dev::block_sum(s, scratch);
  if (threadIdx.x == 0) ss[blockIdx.x] = s;
}

__global__ void rows_rms_scale_kernel(dev::bf16* x, const dev::bf16* w, const float* ss, size_t dim,
                                      float total, float eps) {
  dev::pdl_wait();
  dev::pdl_trigger();
  dev::bf16* row = x + blockIdx.x * dim;
  const float inv = rsqrtf(ss[blockIdx.x] / total + eps);
  for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
    row[i] = __float2bfloat16_rn(__bfloat162float(row[i]) * inv * __bfloat162float(w[i]));
}

}  // namespace

Status row_sumsq_cuda_device(const void* x, size_t rows, size_t dim, float* ss, void* stream) {
  if (rows == 0) return Status::Ok();
  SPARK_CUDA_TRY(dev::launch(row_sumsq_kernel, dim3(static_cast<unsigned>(rows)), dim3(256), 0,
                             static_cast<cudaStream_t>(stream), static_cast<const dev::bf16*>(x),
                             dim, ss));
  SPARK_CUDA_LAUNCHED("row_sumsq");
  return Status::Ok();
}

Status rows_rms_scale_cuda_device(void* x, const void* w, const float* ss, size_t rows, size_t dim,
                                  float total, float eps, void* stream) {
  if (rows == 0) return Status::Ok();
  SPARK_CUDA_TRY(dev::launch(rows_rms_scale_kernel, dim3(static_cast<unsigned>(rows)), dim3(256), 0,
                             static_cast<cudaStream_t>(stream), static_cast<dev::bf16*>(x),
                             static_cast<const dev::bf16*>(w), ss, dim, total, eps));
  SPARK_CUDA_LAUNCHED("rows_rms_scale");
  return Status::Ok();
}

}  // namespace spark::kernels
