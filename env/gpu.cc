#include "env/gpu.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "core/strings.h"
#include "env/sysroot.h"

// The driver API's numbers, declared here because libcuda is never linked. Where the
// toolkit's cuda.h is on the include path, the values are checked against it.
namespace spark::env::drv {
using CUresult = int;
using CUdevice = int;
constexpr CUresult kCudaSuccess = 0;
constexpr int kAttrMultiprocessorCount = 16;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
constexpr int kAttrMaxSharedMemoryPerBlockOptin = 97;
constexpr int kAttrIntegrated = 18;
}  // namespace spark::env::drv
#if __has_include(<cuda.h>)
#include <cuda.h>
namespace spark::env::drv {
static_assert(CUDA_SUCCESS == kCudaSuccess);
static_assert(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT == kAttrMultiprocessorCount);
static_assert(CU_DEVICE_ATTRIBUTE_INTEGRATED == kAttrIntegrated);
static_assert(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR == kAttrComputeCapabilityMajor);
static_assert(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR == kAttrComputeCapabilityMinor);
static_assert(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN ==
              kAttrMaxSharedMemoryPerBlockOptin);
static_assert(sizeof(::CUdevice) == sizeof(CUdevice) && sizeof(::CUresult) == sizeof(CUresult));
}  // namespace spark::env::drv
#endif

namespace spark::env {
namespace {
using namespace drv;

std::string under(const std::string& root, const std::string& path) {
  return (root == "/" ? std::string() : root) + path;
}

// Path of the file a dlopen handle came from (what the loader resolved the soname to).
std::string loaded_path(void* handle) {
  struct link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name) return lm->l_name;
  return {};
}

std::string last_dlerror() {
  const char* e = dlerror();
  return e ? e : "unknown loader error";
}

// Driver entry points (types as in cuda.h).
struct DriverApi {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*driver_get_version)(int*) = nullptr;
  CUresult (*device_get_count)(int*) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_name)(char*, int, CUdevice) = nullptr;
  CUresult (*device_get_attribute)(int*, int, CUdevice) = nullptr;
  CUresult (*device_total_mem)(size_t*, CUdevice) = nullptr;
  CUresult (*device_get_pci_bus_id)(char*, int, CUdevice) = nullptr;  // optional
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;       // optional
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;     // optional

  std::string describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (get_error_name) get_error_name(r, &name);
    if (get_error_string) get_error_string(r, &text);
    return fmt::format("{} ({}): {}", name ? name : "CUDA error", r,
                       text ? text : "no description");
  }
};

template <typename Fn>
bool resolve(void* h, const char* sym, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(h, sym));
  return *out != nullptr;
}

// The part of the report that needs the driver; runs on a worker thread so a hung cuInit
// cannot hang the caller.
struct DriverPart {
  bool loaded = false;
  std::string library;
  int api_version = 0;
  bool initialized = false;
  std::string reason;
  std::vector<GpuDevice> devices;
};

DriverPart query_driver(const std::string& lib) {
  DriverPart p;
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    p.reason = fmt::format(
        "no GPU driver ({} not found: {}); install the NVIDIA driver, or this "
        "node runs the CPU path only",
        lib, last_dlerror());
    return p;
  }
  // Never dlclose the driver: it keeps threads and state that do not survive unloading.
  p.library = loaded_path(h);
  DriverApi api;
  const char* missing = nullptr;
  if (!resolve(h, "cuInit", &api.init))
    missing = "cuInit";
  else if (!resolve(h, "cuDriverGetVersion", &api.driver_get_version))
    missing = "cuDriverGetVersion";
  else if (!resolve(h, "cuDeviceGetCount", &api.device_get_count))
    missing = "cuDeviceGetCount";
  else if (!resolve(h, "cuDeviceGet", &api.device_get))
    missing = "cuDeviceGet";
  else if (!resolve(h, "cuDeviceGetName", &api.device_get_name))
    missing = "cuDeviceGetName";
  else if (!resolve(h, "cuDeviceGetAttribute", &api.device_get_attribute))
    missing = "cuDeviceGetAttribute";
  else if (!resolve(h, "cuDeviceTotalMem_v2", &api.device_total_mem))
    missing = "cuDeviceTotalMem_v2";
  if (missing) {
    p.reason = fmt::format(
        "{} ({}) has no {}: not a CUDA driver library, or one too old; "
        "reinstall the NVIDIA driver",
        lib, p.library, missing);
    return p;
  }
  resolve(h, "cuDeviceGetPCIBusId", &api.device_get_pci_bus_id);
  resolve(h, "cuGetErrorName", &api.get_error_name);
  resolve(h, "cuGetErrorString", &api.get_error_string);
  p.loaded = true;

  if (CUresult r = api.driver_get_version(&p.api_version); r != kCudaSuccess) p.api_version = 0;
  if (CUresult r = api.init(0); r != kCudaSuccess) {
    p.reason = fmt::format(
        "cuInit failed: {}; check `nvidia-smi`, the /dev/nvidia* permissions "
        "and dmesg for Xid errors",
        api.describe(r));
    return p;
  }
  p.initialized = true;
  int count = 0;
  if (CUresult r = api.device_get_count(&count); r != kCudaSuccess) {
    p.reason = fmt::format("cuDeviceGetCount failed: {}", api.describe(r));
    return p;
  }
  if (count == 0) p.reason = "the CUDA driver reports 0 devices (CUDA_VISIBLE_DEVICES empty?)";
  for (int i = 0; i < count; ++i) {
    GpuDevice d;
    d.index = i;
    CUdevice dev = 0;
    if (CUresult r = api.device_get(&dev, i); r != kCudaSuccess) {
      d.errors.push_back(fmt::format("cuDeviceGet({}): {}", i, api.describe(r)));
      p.devices.push_back(std::move(d));
      continue;
    }
    char buf[256] = {};
    if (CUresult r = api.device_get_name(buf, sizeof buf - 1, dev); r == kCudaSuccess)
      d.name = buf;
    else
      d.errors.push_back(fmt::format("cuDeviceGetName: {}", api.describe(r)));
    if (api.device_get_pci_bus_id) {
      char bus[64] = {};
      if (api.device_get_pci_bus_id(bus, sizeof bus - 1, dev) == kCudaSuccess) d.pci_bus_id = bus;
    }
    size_t mem = 0;
    if (CUresult r = api.device_total_mem(&mem, dev); r == kCudaSuccess)
      d.total_memory = mem;
    else
      d.errors.push_back(fmt::format("cuDeviceTotalMem_v2: {}", api.describe(r)));
    int integrated = 0;
    struct {
      int attr;
      const char* name;
      int* out;
    } attrs[] = {
        {kAttrComputeCapabilityMajor, "COMPUTE_CAPABILITY_MAJOR", &d.cc_major},
        {kAttrComputeCapabilityMinor, "COMPUTE_CAPABILITY_MINOR", &d.cc_minor},
        {kAttrMaxSharedMemoryPerBlockOptin, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
         &d.max_smem_per_block_optin},
        {kAttrMultiprocessorCount, "MULTIPROCESSOR_COUNT", &d.multiprocessors},
        {kAttrIntegrated, "INTEGRATED", &integrated},
    };
    for (auto& a : attrs) {
      int v = 0;
      if (CUresult r = api.device_get_attribute(&v, a.attr, dev); r == kCudaSuccess)
        *a.out = v;
      else
        d.errors.push_back(fmt::format("cuDeviceGetAttribute({}): {}", a.name, api.describe(r)));
    }
    d.integrated = integrated != 0;
    p.devices.push_back(std::move(d));
  }
  return p;
}

// Where NCCL is usually installed; named in the message when the loader cannot find it
// but a copy sits in one of these directories.
const char* const kNcclDirs[] = {"/usr/local/cuda/lib64", "/usr/local/cuda/lib",
                                 "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                 "/usr/local/lib"};

void probe_nccl(const std::string& lib, const std::string& root, GpuReport* r) {
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::string err = last_dlerror();
    std::string hint = "install NCCL or add its directory to LD_LIBRARY_PATH";
    for (const char* dir : kNcclDirs) {
      std::string candidate = std::string(dir) + "/" + lib;
      if (access(under(root, candidate).c_str(), F_OK) == 0) {
        hint = fmt::format(
            "{} exists but is not on the loader's path: add {} to LD_LIBRARY_PATH "
            "or /etc/ld.so.conf.d and run ldconfig",
            candidate, dir);
        break;
      }
    }
    r->nccl_reason = fmt::format("{} not found: {}; {}", lib, err, hint);
    return;
  }
  r->nccl_library = loaded_path(h);
  int (*get_version)(int*) = nullptr;
  if (!resolve(h, "ncclGetVersion", &get_version)) {
    r->nccl_reason =
        fmt::format("{} ({}) has no ncclGetVersion: not an NCCL library", lib, r->nccl_library);
    return;
  }
  int code = 0;
  if (int rc = get_version(&code); rc != 0) {
    r->nccl_reason = fmt::format("ncclGetVersion failed with ncclResult {}", rc);
    return;
  }
  r->nccl_loaded = true;
  r->nccl_version_code = code;
}

}  // namespace

std::string cuda_version_text(int v) {
  if (v <= 0) return {};
  return fmt::format("{}.{}", v / 1000, v % 1000 / 10);
}

std::string nccl_version_text(int code) {
  if (code <= 0) return {};
  if (code >= 10000) return fmt::format("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100);
}

std::string read_kernel_module_version(const std::string& root) {
  auto text = read_file_bounded(under(root, "/proc/driver/nvidia/version"), kSysfsReadCap);
  if (!text) return {};
  // "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ..."
  static const std::regex version(R"(Kernel Module[^\n]*?\s(\d+\.\d+(?:\.\d+)?)\s)");
  std::smatch m;
  if (std::regex_search(*text, m, version)) return m[1];
  return {};
}

std::vector<GpuHolder> find_gpu_holders(const std::string& root, int exclude_pid, int* unreadable) {
  std::vector<GpuHolder> out;
  int bad = 0;
  const std::string proc = under(root, "/proc");
  DIR* pd = opendir(proc.c_str());
  if (pd) {
    while (dirent* pe = readdir(pd)) {
      auto pid = parse_u64(pe->d_name);
      if (!pid || static_cast<int>(*pid) == exclude_pid) continue;
      const std::string fd_dir = fmt::format("{}/{}/fd", proc, pe->d_name);
      DIR* fd = opendir(fd_dir.c_str());
      if (!fd) {
        if (errno == EACCES) ++bad;  // ENOENT: the process exited meanwhile
        continue;
      }
      GpuHolder h;
      h.pid = static_cast<int>(*pid);
      while (dirent* fe = readdir(fd)) {
        if (fe->d_name[0] == '.') continue;
        char target[256];
        ssize_t n = readlink((fd_dir + "/" + fe->d_name).c_str(), target, sizeof target - 1);
        if (n <= 0) continue;
        std::string t(target, static_cast<size_t>(n));
        if (starts_with(t, "/dev/nvidia") &&
            std::find(h.devices.begin(), h.devices.end(), t) == h.devices.end())
          h.devices.push_back(t);
      }
      closedir(fd);
      if (h.devices.empty()) continue;
      std::sort(h.devices.begin(), h.devices.end());
      auto comm = read_file_bounded(fmt::format("{}/{}/comm", proc, pe->d_name), kSysfsReadCap);
      h.comm = comm ? escape_invalid_utf8(trim(*comm)) : "?";
      out.push_back(std::move(h));
    }
    closedir(pd);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.pid < b.pid; });
  if (unreadable) *unreadable = bad;
  return out;
}

GpuReport probe_gpu(const GpuProbeOptions& opts) {
  GpuReport r;
  // The driver runs on its own thread: cuInit on a wedged GPU can block for minutes. On a
  // timeout the thread is left behind (detached) and the report says who did not answer.
  auto promise = std::make_shared<std::promise<DriverPart>>();
  auto future = promise->get_future();
  std::thread worker(
      [promise, lib = opts.driver_library] { promise->set_value(query_driver(lib)); });
  r.kernel_module_version = read_kernel_module_version(opts.root);
  probe_nccl(opts.nccl_library, opts.root, &r);
  if (opts.scan_holders) {
    int self = opts.exclude_pid;
    if (self == -1 && opts.root == "/") self = static_cast<int>(getpid());
    r.holders = find_gpu_holders(opts.root, self, &r.holders_unreadable);
  }
  if (future.wait_for(std::chrono::milliseconds(opts.deadline_ms)) == std::future_status::ready) {
    worker.join();
    DriverPart p = future.get();
    r.driver_loaded = p.loaded;
    r.driver_library = std::move(p.library);
    r.driver_api_version = p.api_version;
    r.driver_initialized = p.initialized;
    r.driver_reason = std::move(p.reason);
    r.devices = std::move(p.devices);
  } else {
    worker.detach();
    r.driver_reason = fmt::format(
        "the CUDA driver ({}) did not answer cuInit/device queries within "
        "{} ms; check `nvidia-smi` and dmesg for Xid errors",
        opts.driver_library, opts.deadline_ms);
  }
  return r;
}

nlohmann::json to_json(const GpuReport& r) {
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : r.devices) {
    devices.push_back({{"index", d.index},
                       {"name", d.name},
                       {"pci_bus_id", d.pci_bus_id},
                       {"compute_capability", fmt::format("{}.{}", d.cc_major, d.cc_minor)},
                       {"total_memory_bytes", d.total_memory},
                       {"max_shared_memory_per_block_optin_bytes", d.max_smem_per_block_optin},
                       {"multiprocessors", d.multiprocessors},
                       {"integrated", d.integrated},
                       {"errors", d.errors}});
  }
  nlohmann::json holders = nlohmann::json::array();
  for (const auto& h : r.holders)
    holders.push_back({{"pid", h.pid}, {"comm", h.comm}, {"devices", h.devices}});
  return {
      {"has_gpu", r.has_gpu()},
      {"driver",
       {{"loaded", r.driver_loaded},
        {"library", r.driver_library},
        {"cuda_version", cuda_version_text(r.driver_api_version)},
        {"cuda_version_code", r.driver_api_version},
        {"kernel_module_version", r.kernel_module_version},
        {"initialized", r.driver_initialized},
        {"reason", r.driver_reason}}},
      {"devices", devices},
      {"nccl",
       {{"loaded", r.nccl_loaded},
        {"version", nccl_version_text(r.nccl_version_code)},
        {"version_code", r.nccl_version_code},
        {"library", r.nccl_library},
        {"reason", r.nccl_reason}}},
      {"holders", holders},
      {"holders_unreadable", r.holders_unreadable},
  };
}

Result<GpuReport> gpu_report_from_json(const nlohmann::json& j) {
  // nlohmann throws on missing keys and wrong types; this is the boundary that turns that
  // into an Error.
  try {
    GpuReport r;
    const auto& drv = j.at("driver");
    r.driver_loaded = drv.at("loaded").get<bool>();
    r.driver_library = drv.at("library").get<std::string>();
    r.driver_api_version = drv.at("cuda_version_code").get<int>();
    r.kernel_module_version = drv.at("kernel_module_version").get<std::string>();
    r.driver_initialized = drv.at("initialized").get<bool>();
    r.driver_reason = drv.at("reason").get<std::string>();
    for (const auto& jd : j.at("devices")) {
      GpuDevice d;
      d.index = jd.at("index").get<int>();
      d.name = jd.at("name").get<std::string>();
      d.pci_bus_id = jd.at("pci_bus_id").get<std::string>();
      const auto cc = jd.at("compute_capability").get<std::string>();
      if (std::sscanf(cc.c_str(), "%d.%d", &d.cc_major, &d.cc_minor) != 2)
        return make_error(Errc::io, fmt::format("GPU report: device {}: compute_capability '{}' is "
                                                "not MAJOR.MINOR",
                                                d.index, cc));
      d.total_memory = jd.at("total_memory_bytes").get<uint64_t>();
      d.max_smem_per_block_optin = jd.at("max_shared_memory_per_block_optin_bytes").get<int>();
      d.multiprocessors = jd.at("multiprocessors").get<int>();
      d.integrated = jd.value("integrated", false);  // absent in older captures
      d.errors = jd.at("errors").get<std::vector<std::string>>();
      r.devices.push_back(std::move(d));
    }
    const auto& nccl = j.at("nccl");
    r.nccl_loaded = nccl.at("loaded").get<bool>();
    r.nccl_version_code = nccl.at("version_code").get<int>();
    r.nccl_library = nccl.at("library").get<std::string>();
    r.nccl_reason = nccl.at("reason").get<std::string>();
    for (const auto& jh : j.at("holders"))
      r.holders.push_back({jh.at("pid").get<int>(), jh.at("comm").get<std::string>(),
                           jh.at("devices").get<std::vector<std::string>>()});
    r.holders_unreadable = j.at("holders_unreadable").get<int>();
    return r;
  } catch (const nlohmann::json::exception& e) {
    return make_error(Errc::io, fmt::format("GPU report: {}", e.what()));
  }
}

std::optional<bool> cuda_archs_cover(std::string_view archs, int major, int minor) {
  std::string list(archs);
  std::replace(list.begin(), list.end(), ';', ',');
  auto entries = split_list(list, ',');
  if (entries.empty()) return std::nullopt;
  const int cc = major * 10 + minor;
  bool any = false;
  for (const auto& e : entries) {
    std::string_view v = e;
    bool real = true, virt = true;
    if (ends_with(v, "-real")) {
      virt = false;
      v.remove_suffix(5);
    } else if (ends_with(v, "-virtual")) {
      real = false;
      v.remove_suffix(8);
    }
    char suffix = 0;
    if (!v.empty() && (v.back() == 'a' || v.back() == 'f')) {
      suffix = v.back();
      v.remove_suffix(1);
    }
    auto n = parse_u64(v);
    if (!n) return std::nullopt;  // "native", "all", "all-major": not known here
    int arch = static_cast<int>(*n), am = arch / 10, an = arch % 10;
    if (suffix == 'a') {
      any = any || arch == cc;  // architecture-specific: that architecture only
    } else if (suffix == 'f') {
      any = any || (am == major && an <= minor);  // family: later minors of the major
    } else {
      if (real && am == major && an <= minor) any = true;
      if (virt && arch <= cc) any = true;
    }
  }
  return any;
}

}  // namespace spark::env
