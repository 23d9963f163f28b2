// CUDA runtime queries and the error helper shared by the .cu files.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

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

namespace {

// A kernel whose image must load on the device for this build to run there.
__global__ void probe_kernel(int* p) {
  if (p) *p = 1;
}

std::mutex g_limits_mu;
std::vector<DeviceLimits>& limits_cache() {
  static std::vector<DeviceLimits> c;
  return c;
}

}  // namespace

std::string describe_device(const DeviceLimits& d) {
  return "sm_" + std::to_string(d.cc_major * 10 + d.cc_minor) + " (" + d.name + ", device " +
         std::to_string(d.device) + ")";
}

Result<DeviceLimits> cuda_device_limits(int device) {
  if (device < 0) SPARK_CUDA_TRY(cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lk(g_limits_mu);
    for (const auto& l : limits_cache())
      if (l.device == device) return l;
  }
  cudaDeviceProp p{};
  SPARK_CUDA_TRY(cudaGetDeviceProperties(&p, device));
  DeviceLimits l;
  l.device = device;
  l.name = p.name;
  l.cc_major = p.major;
  l.cc_minor = p.minor;
  l.sm_count = p.multiProcessorCount;
  l.smem_per_block = p.sharedMemPerBlock;
  l.smem_per_block_optin = p.sharedMemPerBlockOptin;
  l.smem_per_sm = p.sharedMemPerMultiprocessor;
  l.max_threads_per_block = p.maxThreadsPerBlock;
  l.total_memory = p.totalGlobalMem;
  l.l2_bytes = static_cast<size_t>(p.l2CacheSize);
  l.integrated = p.integrated != 0;
  static const char* hex = "0123456789abcdef";
  l.uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    const auto b = static_cast<unsigned char>(p.uuid.bytes[i]);
    l.uuid += hex[b >> 4];
    l.uuid += hex[b & 15];
  }
  l.can_map_host_memory = p.canMapHostMemory != 0;
  l.host_pointer_is_device = p.canUseHostPointerForRegisteredMem != 0;
  l.pageable_memory_access = p.pageableMemoryAccess != 0;
  l.pageable_uses_host_pages = p.pageableMemoryAccessUsesHostPageTables != 0;
  l.host_register_supported = p.hostRegisterSupported != 0;
  l.cluster_launch = p.clusterLaunch != 0;
  int ro = 0;
  if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, device) != cudaSuccess)
    (void)cudaGetLastError(), ro = 0;
  l.read_only_host_register = ro != 0;
  std::lock_guard<std::mutex> lk(g_limits_mu);
  limits_cache().push_back(l);
  return l;
}

Status cuda_select_device(int device) {
  SPARK_TRY(cuda_device_count().status());
  SPARK_CUDA_TRY(cudaSetDevice(device));
  auto l = cuda_device_limits(device);
  SPARK_TRY(l.status());
  const std::string problem = cuda_arch_problem(*l, cuda_architectures());
  if (!problem.empty()) return make_error(Errc::unsupported, problem);
  const std::string fix = "rebuild with -DCMAKE_CUDA_ARCHITECTURES=\"" +
                          std::to_string(l->cc_major * 10 + l->cc_minor) +
                          "\" (or add it to the list), or set DEVICE=cpu to run on the CPU";
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(detail::errc_for_cuda(e),
                      describe_device(*l) + ": the kernels of this build do not load (" +
                          cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + "): " + fix);
  }
  return Status::Ok();
}

Status cuda_check_launch(const char* kernel, unsigned threads, size_t smem_bytes) {
  auto l = cuda_device_limits(-1);
  SPARK_TRY(l.status());
  if (threads == 0 || threads > static_cast<unsigned>(l->max_threads_per_block))
    return make_error(Errc::resource, std::string(kernel) + ": needs " + std::to_string(threads) +
                                          " threads per block, " + describe_device(*l) +
                                          " allows " + std::to_string(l->max_threads_per_block));
  if (smem_bytes > l->smem_per_block_optin)
    return make_error(Errc::resource,
                      std::string(kernel) + ": needs " + std::to_string(smem_bytes) +
                          " bytes of shared memory per block, " + describe_device(*l) + " allows " +
                          std::to_string(l->smem_per_block_optin) +
                          " (a smaller head_dim or tile, or a GPU with more)");
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
