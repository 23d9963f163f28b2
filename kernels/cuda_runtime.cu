// CUDA runtime queries and the error helper shared by the .cu files.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>

#include "kernels/cuda_check.cuh"
#include "kernels/cuda_runtime.h"

namespace spark::kernels {
namespace detail {

Errc errc_for_cuda(cudaError_t e) {
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorDevicesUnavailable:
      return Errc::unsupported;
    case cudaErrorMemoryAllocation:
      return Errc::resource;
    default:
      return Errc::internal;
  }
}

Error cuda_error(cudaError_t e, const char* expr, const char* file, int line) {
  // nvcc passes absolute paths; keep the part from the component directory on.
  const char* rel = std::strstr(file, "kernels/");
  std::string msg = std::string(rel ? rel : file) + ":" + std::to_string(line) + ": " + expr +
                    " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorNoKernelImageForDevice)
    msg += " (rebuild with CMAKE_CUDA_ARCHITECTURES including this GPU's compute capability)";
  return make_error(errc_for_cuda(e), std::move(msg));
}

}  // namespace detail

bool built_with_cuda() {
  return true;
}

std::string cuda_architectures() {
#ifdef SPARK_CUDA_ARCHITECTURES
  return SPARK_CUDA_ARCHITECTURES;
#else
  return "unknown";
#endif
}

std::string cuda_runtime_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
}

Result<int> cuda_device_count() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    std::string msg =
        std::string("no CUDA device: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    if (e == cudaErrorInsufficientDriver)
      msg += " (no GPU driver is loaded, or it is older than CUDA " + cuda_runtime_version() +
             "; `sparkctl version` shows what was found)";
    return make_error(Errc::unsupported, std::move(msg));
  }
  if (n == 0) return make_error(Errc::unsupported, "no CUDA device: the driver reports 0 devices");
  return n;
}

Status cuda_synchronize() {
  SPARK_CUDA_TRY(cudaDeviceSynchronize());
  return Status::Ok();
}

Result<DeviceMemory> DeviceMemory::allocate(size_t bytes) {
  DeviceMemory m;
  SPARK_CUDA_TRY(cudaMalloc(&m.p_, bytes));
  m.n_ = bytes;
  return Result<DeviceMemory>(std::move(m));
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = o.p_, n_ = o.n_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

DeviceMemory::~DeviceMemory() {
  if (p_) cudaFree(p_);
}

Status DeviceMemory::copy_from_host(const void* src, size_t bytes) {
  if (bytes > n_)
    return make_error(Errc::usage, "DeviceMemory::copy_from_host: " + std::to_string(bytes) +
                                       " bytes into a buffer of " + std::to_string(n_));
  SPARK_CUDA_TRY(cudaMemcpy(p_, src, bytes, cudaMemcpyHostToDevice));
  return Status::Ok();
}

Status DeviceMemory::copy_to_host(void* dst, size_t bytes) const {
  if (bytes > n_)
    return make_error(Errc::usage, "DeviceMemory::copy_to_host: " + std::to_string(bytes) +
                                       " bytes from a buffer of " + std::to_string(n_));
  SPARK_CUDA_TRY(cudaMemcpy(dst, p_, bytes, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

}  // namespace spark::kernels
