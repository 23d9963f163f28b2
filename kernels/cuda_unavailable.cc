// The CUDA entry points of a build without CUDA: each says so instead of failing to link.
#if !defined(SPARK_HAVE_CUDA)

#include <utility>

#include "kernels/cuda_runtime.h"
#include "kernels/rmsnorm.h"
#include "kernels/swiglu.h"

namespace spark::kernels {
namespace {
Error no_cuda(const char* what) {
  return make_error(Errc::unsupported,
                    std::string(what) +
                        ": built without CUDA (nvcc was not found at configure time; "
                        "reconfigure with CUDA installed and SPARK_CUDA=ON)");
}
}  // namespace

bool built_with_cuda() {
  return false;
}
Result<int> cuda_device_count() {
  return no_cuda("cuda_device_count");
}
std::string cuda_runtime_version() {
  return {};
}
std::string cuda_architectures() {
  return {};
}

Status cuda_synchronize() {
  return no_cuda("cuda_synchronize");
}
Result<DeviceMemory> DeviceMemory::allocate(size_t) {
  return no_cuda("DeviceMemory::allocate");
}
DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept {
  std::swap(p_, o.p_), std::swap(n_, o.n_);
  return *this;
}
DeviceMemory::~DeviceMemory() = default;
Status DeviceMemory::copy_from_host(const void*, size_t) {
  return no_cuda("DeviceMemory::copy_from_host");
}
Status DeviceMemory::copy_to_host(void*, size_t) const {
  return no_cuda("DeviceMemory::copy_to_host");
}

// Argument errors come first, as in the CUDA build, so callers see the same contract.
Status rmsnorm_cuda(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(float)));
  return no_cuda("rmsnorm_cuda");
}
Status rmsnorm_bf16_cuda(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows,
                         size_t dim, float eps) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(bf16_bits)));
  return no_cuda("rmsnorm_bf16_cuda");
}
Status rmsnorm_cuda_device(const float* x, const float* w, float* y, size_t rows, size_t dim,
                           float eps, void*) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(float)));
  return no_cuda("rmsnorm_cuda_device");
}
Status rmsnorm_bf16_cuda_device(const bf16_bits* x, const bf16_bits* w, bf16_bits* y, size_t rows,
                                size_t dim, float eps, void*) {
  SPARK_TRY(rmsnorm_check_args(x, w, y, rows, dim, eps, sizeof(bf16_bits)));
  return no_cuda("rmsnorm_bf16_cuda_device");
}

Status swiglu_cuda(const float* gate_up, float* y, size_t rows, size_t dim) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(float)));
  return no_cuda("swiglu_cuda");
}
Status swiglu_bf16_cuda(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(bf16_bits)));
  return no_cuda("swiglu_bf16_cuda");
}
Status swiglu_cuda_device(const float* gate_up, float* y, size_t rows, size_t dim, void*) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(float)));
  return no_cuda("swiglu_cuda_device");
}
Status swiglu_bf16_cuda_device(const bf16_bits* gate_up, bf16_bits* y, size_t rows, size_t dim,
                               void*) {
  SPARK_TRY(swiglu_check_args(gate_up, y, rows, dim, sizeof(bf16_bits)));
  return no_cuda("swiglu_bf16_cuda_device");
}

}  // namespace spark::kernels

#endif
