// The GPU probe: on this machine as it is, with vendor libraries that are missing or wrong,
// with a fault-injecting driver, and on captured /proc trees.
#include "env/gpu.h"

#include <dlfcn.h>
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "support/tempdir.h"

using namespace spark;
using namespace spark::env;

namespace {

bool loadable(const char* lib) {
  void* h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL);
  return h != nullptr;  // left open: the probe opens the same library anyway
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The fault-injection driver: where CMake built it, else next to this test binary (the
// staged copy on the GPU machine).
std::string fault_libcuda() {
  std::string built = FAULT_INJECT_LIBCUDA;
  if (std::filesystem::exists(built)) return built;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() /
          std::filesystem::path(built).filename())
      .string();
}

// A function of the fault-injection libcuda (the probe's dlopen finds the same copy).
template <typename Fn>
Fn fault_fn(const char* name) {
  void* h = dlopen(fault_libcuda().c_str(), RTLD_NOW | RTLD_LOCAL);
  const bool opened = h != nullptr;
  REQUIRE_MESSAGE(opened, dlerror());
  auto fn = reinterpret_cast<Fn>(dlsym(h, name));
  const bool found = fn != nullptr;
  REQUIRE_MESSAGE(found, name << " missing");
  return fn;
}

void set_fault_mode(int mode) {
  fault_fn<void (*)(int)>("spark_fault_set_mode")(mode);
}

}  // namespace

TEST_CASE("the probe on this machine reports what the loader can find, without crashing") {
  GpuReport r = probe_gpu();
  if (!loadable("libcuda.so.1")) {
    CHECK_FALSE(r.driver_loaded);
    CHECK_FALSE(r.has_gpu());
    CHECK(r.devices.empty());
    CHECK(contains(r.driver_reason, "no GPU driver"));
    CHECK(contains(r.driver_reason, "libcuda.so.1"));
  } else {
    CHECK(r.driver_loaded);
    CHECK(std::filesystem::exists(r.driver_library));
    CHECK(r.driver_api_version >= 1000);
    if (r.has_gpu()) CHECK(r.driver_reason.empty());
  }
  if (loadable("libnccl.so.2")) {
    CHECK(r.nccl_loaded);
    CHECK(std::regex_match(nccl_version_text(r.nccl_version_code), std::regex(R"(2\.\d+\.\d+)")));
    CHECK(std::filesystem::path(r.nccl_library).filename().string().rfind("libnccl.so", 0) == 0);
    CHECK(std::filesystem::exists(r.nccl_library));
  } else {
    CHECK_FALSE(r.nccl_loaded);
    CHECK(contains(r.nccl_reason, "libnccl.so.2"));
  }
  auto j = to_json(r);
  CHECK(j["has_gpu"] == r.has_gpu());
  CHECK(j["driver"]["reason"] == r.driver_reason);
}

TEST_CASE("a driver library that does not exist is reported as no GPU driver") {
  GpuProbeOptions o;
  o.driver_library = "libcuda-spark-fault-injection-missing.so.1";
  o.nccl_library = "libnccl-spark-fault-injection-missing.so.2";
  o.scan_holders = false;
  GpuReport r = probe_gpu(o);
  CHECK_FALSE(r.driver_loaded);
  CHECK_FALSE(r.has_gpu());
  CHECK(r.driver_library.empty());
  CHECK(contains(r.driver_reason,
                 "no GPU driver (libcuda-spark-fault-injection-missing.so.1 not found"));
  CHECK_FALSE(r.nccl_loaded);
  CHECK(r.nccl_version_code == 0);
  CHECK(contains(r.nccl_reason, "libnccl-spark-fault-injection-missing.so.2 not found"));
  CHECK(to_json(r)["nccl"]["version"] == "");
}

TEST_CASE("a library without the driver's entry points is named as not a CUDA driver") {
  GpuProbeOptions o;
  o.driver_library = "libm.so.6";  // real, loadable, no cuInit
  o.nccl_library = "libm.so.6";
  o.scan_holders = false;
  GpuReport r = probe_gpu(o);
  CHECK_FALSE(r.driver_loaded);
  CHECK(contains(r.driver_reason, "has no cuInit"));
  CHECK(contains(r.driver_reason, "libm.so.6"));
  CHECK(contains(r.nccl_reason, "has no ncclGetVersion"));
}

TEST_CASE("fault injection: cuInit fails, hangs, or one attribute query fails") {
  GpuProbeOptions o;
  o.driver_library = fault_libcuda();
  o.scan_holders = false;
  o.nccl_library = "libnccl-spark-fault-injection-missing.so.2";

  SUBCASE("cuInit returns CUDA_ERROR_NO_DEVICE") {
    set_fault_mode(0);
    GpuReport r = probe_gpu(o);
    CHECK(r.driver_loaded);
    CHECK(r.driver_api_version == 13000);
    CHECK_FALSE(r.driver_initialized);
    CHECK_FALSE(r.has_gpu());
    CHECK(contains(r.driver_reason,
                   "cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device"));
  }
  SUBCASE("cuInit hangs past the deadline") {
    set_fault_mode(1);
    o.deadline_ms = 200;
    GpuReport r = probe_gpu(o);
    // The probe came back while cuInit was still hung (it returns only when released):
    // the deadline ended the wait, not the call.
    const int returned = fault_fn<int (*)()>("spark_fault_init_returned")();
    fault_fn<void (*)()>("spark_fault_release")();
    CHECK(returned == 0);
    CHECK_FALSE(r.has_gpu());
    CHECK(contains(r.driver_reason, "did not answer"));
    CHECK(contains(r.driver_reason, "200 ms"));
  }
  SUBCASE("a failed optional query marks its field and the probe goes on") {
    set_fault_mode(2);
    GpuReport r = probe_gpu(o);
    REQUIRE(r.has_gpu());
    REQUIRE(r.devices.size() == 1);
    const auto& d = r.devices[0];
    CHECK(d.name == "Fault Injection GPU");
    CHECK(d.cc_major == 9);
    CHECK(d.multiprocessors == 132);
    CHECK(d.total_memory == (1ull << 30));
    CHECK(d.max_smem_per_block_optin == 0);
    REQUIRE(d.errors.size() == 1);
    CHECK(contains(d.errors[0], "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"));
    CHECK(contains(d.errors[0], "CUDA_ERROR_INVALID_VALUE"));
    auto j = to_json(r);
    CHECK(j["devices"][0]["compute_capability"] == "9.0");
    CHECK(j["driver"]["cuda_version"] == "13.0");
  }
}

TEST_CASE("version numbers render as the vendors write them") {
  CHECK(cuda_version_text(13000) == "13.0");
  CHECK(cuda_version_text(12080) == "12.8");
  CHECK(cuda_version_text(0).empty());
  CHECK(nccl_version_text(22703) == "2.27.3");
  CHECK(nccl_version_text(21903) == "2.19.3");
  CHECK(nccl_version_text(2804) == "2.8.4");
  CHECK(nccl_version_text(0).empty());
}

TEST_CASE("kernel module version and GPU holders come from a captured /proc tree") {
  test::TempDir root("spark-gpu-probe");
  root.write("proc/driver/nvidia/version",
             "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
             "(dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:54:35 UTC 2025\n"
             "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n");
  CHECK(read_kernel_module_version(root.path()) == "580.95.05");
  CHECK(read_kernel_module_version(root / "nonexistent").empty());

  // pid 100 holds the GPU (twice the same file, plus the control device); 200 holds
  // nothing of NVIDIA's; 300 holds it but is the prober itself.
  auto fd = [&](int pid, int n, const std::string& target) {
    std::filesystem::create_directories(root / ("proc/" + std::to_string(pid) + "/fd"));
    std::filesystem::create_symlink(
        target, root / ("proc/" + std::to_string(pid) + "/fd/" + std::to_string(n)));
  };
  root.write("proc/100/comm", "python3\n");
  fd(100, 3, "/dev/nvidia0");
  fd(100, 4, "/dev/nvidiactl");
  fd(100, 5, "/dev/nvidia0");
  fd(100, 6, "socket:[1234]");
  root.write("proc/200/comm", "bash\n");
  fd(200, 0, "/dev/null");
  root.write("proc/300/comm", "sparkctl\n");
  fd(300, 3, "/dev/nvidia-uvm");
  root.write("proc/meminfo", "MemTotal: 1 kB\n");  // not a pid directory

  int unreadable = -1;
  auto holders = find_gpu_holders(root.path(), 300, &unreadable);
  REQUIRE(holders.size() == 1);
  CHECK(holders[0].pid == 100);
  CHECK(holders[0].comm == "python3");
  CHECK(holders[0].devices == std::vector<std::string>{"/dev/nvidia0", "/dev/nvidiactl"});
  CHECK(unreadable == 0);
  CHECK(find_gpu_holders(root.path(), -1, nullptr).size() == 2);

  GpuProbeOptions o;
  o.root = root.path();
  o.driver_library = "libcuda-spark-fault-injection-missing.so.1";
  o.exclude_pid = 300;
  GpuReport r = probe_gpu(o);
  CHECK(r.kernel_module_version == "580.95.05");
  // NCCL the loader cannot find, but present in a usual directory: the message says where.
  o.nccl_library = "libnccl-spark-fault-injection.so.2";
  root.write("usr/local/cuda/lib64/libnccl-spark-fault-injection.so.2", "not really a library");
  r = probe_gpu(o);
  CHECK_FALSE(r.nccl_loaded);
  CHECK(contains(r.nccl_reason,
                 "/usr/local/cuda/lib64/libnccl-spark-fault-injection.so.2 exists but is not on "
                 "the loader's path"));
  REQUIRE(r.holders.size() == 1);
  CHECK(to_json(r)["holders"][0]["comm"] == "python3");
}

TEST_CASE("a GPU report survives a JSON round trip; a damaged one is refused with the field") {
  GpuReport r;
  r.driver_loaded = r.driver_initialized = true;
  r.driver_library = "/usr/lib/x86_64-linux-gnu/libcuda.so.1";
  r.driver_api_version = 13000;
  r.kernel_module_version = "580.95.05";
  r.devices.push_back({0, "NVIDIA H200", "0000:19:00.0", 9, 0, 150ull << 30, 232448, 132, {}});
  r.devices.push_back(
      {1, "NVIDIA GB10", "", 12, 1, 120ull << 30, 101376, 48, {"cuDeviceGetPCIBusId: x"}});
  r.nccl_loaded = true;
  r.nccl_version_code = 22809;
  r.nccl_library = "/usr/lib/libnccl.so.2";
  r.holders.push_back({77, "python3", {"/dev/nvidia0"}});
  r.holders_unreadable = 2;
  auto back = gpu_report_from_json(to_json(r));
  REQUIRE(back.ok());
  CHECK(to_json(*back) == to_json(r));
  CHECK(back->devices[1].cc_minor == 1);
  CHECK(back->has_gpu());

  auto j = to_json(r);
  j["nccl"].erase("version_code");
  auto bad = gpu_report_from_json(j);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::io);
  CHECK(contains(bad.error().message, "version_code"));
  j = to_json(r);
  j["devices"][0]["compute_capability"] = "nine";
  CHECK(contains(gpu_report_from_json(j).error().message, "compute_capability 'nine'"));
}
