// Device-to-device copies on a stream.
#include <cuda_runtime.h>

#include "kernels/cuda_check.cuh"
#include "kernels/device_copy.h"

namespace spark::kernels {

Status device_copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  if (bytes == 0) return Status::Ok();
  if (!dst || !src) return make_error(Errc::internal, "device_copy_async: null pointer");
  SPARK_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                 static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<bool> stream_done(void* stream) {
  cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  SPARK_CUDA_TRY(e);
  return true;
}

Status stream_synchronize(void* stream) {
  SPARK_CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

}  // namespace spark::kernels
