// Deterministic random fills on the device (kernels/fill.h): the host's hash, per element.
#include <algorithm>

#include "kernels/cuda_check.cuh"
#include "kernels/device_common.cuh"
#include "kernels/fill.h"

namespace spark::kernels {
namespace {

__device__ __forceinline__ float fill_value_dev(uint64_t seed, uint64_t i, float scale,
                                                float offset) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
  return offset + scale * (2.0f * u - 1.0f);
}

template <typename T>
__global__ void fill_kernel(T* dst, size_t n, uint64_t seed, float scale, float offset) {
  dev::pdl_wait();
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    dst[i] = dev::from_f<T>(fill_value_dev(seed, i, scale, offset));
}

}  // namespace

Status fill_random_cuda_device(void* dst, DType t, size_t n, uint64_t seed, float scale,
                               float offset, void* stream) {
  if (n == 0) return Status::Ok();
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 1u << 16));
  SPARK_DISPATCH_DTYPE(t, T,
                       SPARK_CUDA_TRY(dev::launch(fill_kernel<T>, dim3(blocks), dim3(256), 0,
                                                  static_cast<cudaStream_t>(stream),
                                                  static_cast<T*>(dst), n, seed, scale, offset)));
  SPARK_CUDA_LAUNCHED("fill_random");
  return Status::Ok();
}

}  // namespace spark::kernels
