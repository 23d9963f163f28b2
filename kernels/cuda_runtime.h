#pragma once
// What the CUDA runtime (linked statically; it loads the driver at run time) can see, for
// callers that do not include CUDA headers. In a build without CUDA every call returns
// Errc::unsupported with "built without CUDA".
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark::kernels {

/// True when this binary contains the CUDA kernels (SPARK_HAVE_CUDA at build time).
bool built_with_cuda();

/// Number of CUDA devices visible to this process (>= 1), or Errc::unsupported naming why
/// none can be used ("no CUDA device: <CUDA error string>").
Result<int> cuda_device_count();

/// The GPU architectures this build has kernels for, e.g. "90,121"; empty without CUDA.
std::string cuda_architectures();

/// Version of the CUDA runtime compiled in, e.g. "13.0"; empty without CUDA.
std::string cuda_runtime_version();

/// Waits for all work on the current device (cudaDeviceSynchronize) and reports its errors.
Status cuda_synchronize();

/// Device memory owned by one object (freed when it goes away); move-only. For the engine
/// and for tests that drive the device-pointer entry points without CUDA headers.
class DeviceMemory {
 public:
  /// Allocates `bytes` on the current device (Errc::resource when it does not fit).
  static Result<DeviceMemory> allocate(size_t bytes);
  DeviceMemory() = default;
  DeviceMemory(DeviceMemory&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();
  void* get() const { return p_; }
  size_t size() const { return n_; }
  /// Copies `bytes` (<= size()) from host memory to the start of this buffer, synchronously.
  Status copy_from_host(const void* src, size_t bytes);
  /// Copies `bytes` (<= size()) from the start of this buffer to host memory, synchronously.
  Status copy_to_host(void* dst, size_t bytes) const;

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

/// What a device can do, as the kernels need it before a launch.
struct DeviceLimits {
  int device = 0;
  std::string name;  // "NVIDIA H200"
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t smem_per_block = 0;        // without opt-in (48 KiB)
  size_t smem_per_block_optin = 0;  // the most a kernel may ask for (227 KiB H200, 99 KiB GB10)
  size_t smem_per_sm = 0;
  int max_threads_per_block = 0;
  size_t total_memory = 0;
  size_t l2_bytes = 0;
  bool integrated = false;  // memory shared with the host (GB10)
  std::string uuid;         // "GPU-<hex>": one physical GPU, whatever CUDA_VISIBLE_DEVICES says
  // How the GPU reaches host memory, for weights read in place (host-mapped placement):
  bool can_map_host_memory = false;       // page-locked host memory is GPU-addressable
  bool host_pointer_is_device = false;    // ... at the same address (no cudaHostGetDevicePointer)
  bool pageable_memory_access = false;    // plain malloc'd memory is GPU-addressable (HMM/ATS)
  bool pageable_uses_host_pages = false;  // ... through the host's page tables (ATS, GB10)
  bool host_register_supported = false;   // cudaHostRegister works
  bool read_only_host_register = false;   // ... also on read-only mappings
  bool cluster_launch = false;            // thread-block clusters (sm_90 and later)
};

/// The limits of `device` (-1: the current device); cached per device after the first call.
Result<DeviceLimits> cuda_device_limits(int device = -1);

/// "sm_90 (NVIDIA H200, device 0)": how messages name a device.
std::string describe_device(const DeviceLimits& d);

/// Makes `device` current and checks this build can run on it: its compute capability is
/// among cuda_architectures() and a kernel image loads. Call at device selection, so an
/// unsupported GPU fails at start: Errc::unsupported naming the device, its sm and the
/// architectures built, with the rebuild to do.
Status cuda_select_device(int device);

/// The oldest compute capability the kernels run on (x10): sm_80 (cp.async, bf16 math).
inline constexpr int kCudaMinSm = 80;

/// The architectures of a CMAKE_CUDA_ARCHITECTURES list: "90a,121a" -> {90, 121}, "80-real"
/// -> {80}; entries without a number ("native") are left out.
std::vector<int> parse_cuda_architectures(std::string_view list);

/// Why a build with kernels for `compiled` (cuda_architectures()) cannot run on device `d`:
/// older than sm_80, or its compute capability is not in the list (with the rebuild to do
/// and DEVICE=cpu); "" when it can, or when the list names no architecture ("native").
std::string cuda_arch_problem(const DeviceLimits& d, std::string_view compiled);

/// Whether the sm_90 paths (thread-block clusters, programmatic dependent launch) run on a
/// GPU of compute capability `cc_major`.x: never before sm_90, nor when the fallbacks are
/// forced (SPARK_CUDA_FALLBACKS=1, set_cuda_fallbacks()).
bool cuda_hopper_paths(int cc_major, bool fallbacks);

/// Checks a launch against the current device's limits before making it: Errc::resource
/// "<kernel>: needs <what> <n>, <device> allows <limit>" when `threads` or `smem_bytes`
/// (dynamic shared memory) is past them.
Status cuda_check_launch(const char* kernel, unsigned threads, size_t smem_bytes);

}  // namespace spark::kernels
