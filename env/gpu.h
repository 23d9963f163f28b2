#pragma once
// The GPU side of a node, probed at run time without linking any NVIDIA library: the CUDA
// driver (libcuda.so.1, driver API) and NCCL (libnccl.so.2) are opened with dlopen, so a
// node without them gets a report that says so instead of a binary that fails to start.
// Files (/proc/driver/nvidia, /proc/<pid>/fd) are read through a root directory so a
// captured tree replays like a live node.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark::env {

/// One CUDA device as the driver reports it. A failed query leaves its field at zero/empty
/// and adds a line to `errors`; the probe goes on.
struct GpuDevice {
  int index = 0;
  std::string name;
  std::string pci_bus_id;  // "0000:19:00.0"
  int cc_major = 0;
  int cc_minor = 0;
  uint64_t total_memory = 0;         // bytes
  int max_smem_per_block_optin = 0;  // bytes
  int multiprocessors = 0;
  std::vector<std::string> errors;
  bool integrated = false;  // shares the host's memory (GB10, Jetson): unified memory
};

/// A process other than the prober that holds an NVIDIA device file open.
struct GpuHolder {
  int pid = 0;
  std::string comm;
  std::vector<std::string> devices;  // "/dev/nvidia0", "/dev/nvidiactl", ...
};

/// What the GPU probe found. Empty reasons mean "nothing wrong".
struct GpuReport {
  bool driver_loaded = false;         // libcuda.so.1 opened and its entry points resolved
  std::string driver_library;         // resolved path of the library that was opened
  int driver_api_version = 0;         // cuDriverGetVersion, e.g. 13000
  std::string kernel_module_version;  // from /proc/driver/nvidia/version, e.g. "580.95.05"
  bool driver_initialized = false;    // cuInit(0) succeeded
  std::string driver_reason;  // why there is no usable GPU ("no GPU driver (libcuda.so.1 ...")
  std::vector<GpuDevice> devices;

  bool nccl_loaded = false;
  int nccl_version_code = 0;  // ncclGetVersion, e.g. 22703
  std::string nccl_library;   // resolved path of libnccl.so.2
  std::string nccl_reason;

  std::vector<GpuHolder> holders;  // processes (not the prober) with /dev/nvidia* open
  int holders_unreadable = 0;      // processes whose fd table could not be read

  /// True when the driver initialised and listed at least one device.
  bool has_gpu() const { return driver_initialized && !devices.empty(); }
};

/// Where and how to probe; the library names are seams for fault injection.
struct GpuProbeOptions {
  std::string root = "/";  // for /proc reads
  std::string driver_library = "libcuda.so.1";
  std::string nccl_library = "libnccl.so.2";
  int deadline_ms = 20000;  // cuInit and device queries give up after this
  bool scan_holders = true;
  int exclude_pid = -1;  // -1: this process when root is "/", nobody otherwise
};

/// Probes the driver, its devices, NCCL and the processes holding the GPU.
GpuReport probe_gpu(const GpuProbeOptions& opts = {});

/// "13.0" for a CUDA version number such as 13000; "" for 0.
std::string cuda_version_text(int version);
/// "2.27.3" for an NCCL version code (22703, or the pre-2.9 scheme 2804 -> "2.8.4"); "" for 0.
std::string nccl_version_text(int code);
/// The kernel module version in <root>/proc/driver/nvidia/version, "" when absent.
std::string read_kernel_module_version(const std::string& root);
/// Processes under <root>/proc with an open /dev/nvidia* file, other than `exclude_pid`;
/// counts those whose fd table cannot be read into *unreadable.
std::vector<GpuHolder> find_gpu_holders(const std::string& root, int exclude_pid, int* unreadable);

/// The report as JSON (the schema `sparkctl version --json` prints under "gpu").
nlohmann::json to_json(const GpuReport& r);
/// Reads a report back from to_json's output (a node capture, another node's answer);
/// Errc::io naming the first missing or mistyped field.
Result<GpuReport> gpu_report_from_json(const nlohmann::json& j);

/// Whether a build for `archs` (CMAKE_CUDA_ARCHITECTURES, ","- or ";"-separated: "121a",
/// "90-real", "80-virtual", "86") has code a GPU of compute capability major.minor runs:
/// machine code for its exact architecture ("a"/"f" suffixes) or an earlier minor of its
/// major, or PTX of an architecture at or below it. nullopt when the list says nothing
/// checkable ("", "native", "all").
std::optional<bool> cuda_archs_cover(std::string_view archs, int major, int minor);

}  // namespace spark::env
