// sparkctl version: text and JSON agree with what the GPU probe finds on this machine.
#include "spark/version.h"

#include <dlfcn.h>
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "cli/cmd_version.h"
#include "kernels/cuda_runtime.h"

using namespace spark;

namespace {
int run_cli(std::vector<const char*> argv, std::string* out, std::string* err) {
  std::ostringstream o, e;
  argv.insert(argv.begin(), "sparkctl");
  int rc = cli::run(static_cast<int>(argv.size()), argv.data(), o, e, Environment{});
  *out = o.str();
  *err = e.str();
  return rc;
}
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("sparkctl version --json reports the build, the driver and NCCL") {
  std::string out, err;
  REQUIRE(run_cli({"version", "--json"}, &out, &err) == 0);
  auto j = nlohmann::json::parse(out);
  CHECK(j["sparkctl"] == kVersion);
  CHECK(j["build"]["cuda"] == kernels::built_with_cuda());
  // sparkctl reports the build from configure-time facts; the kernels library must agree.
  CHECK(j["build"]["cuda_runtime"] == kernels::cuda_runtime_version());
  CHECK(j["build"]["cuda_architectures"] == kernels::cuda_architectures());
  REQUIRE(j.contains("gpu"));
  const bool driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) != nullptr;
  CHECK(j["gpu"]["driver"]["loaded"] == driver);
  if (!driver) {
    CHECK(j["gpu"]["has_gpu"] == false);
    CHECK(has(j["gpu"]["driver"]["reason"].get<std::string>(), "libcuda.so.1"));
  }
  const bool nccl = dlopen("libnccl.so.2", RTLD_LAZY | RTLD_LOCAL) != nullptr;
  CHECK(j["gpu"]["nccl"]["loaded"] == nccl);
  if (nccl)
    CHECK(j["gpu"]["nccl"]["library"].get<std::string>().find("libnccl.so") != std::string::npos);
}

TEST_CASE("sparkctl version prints one fact per line; --short and --version skip the probe") {
  std::string out, err;
  REQUIRE(run_cli({"version"}, &out, &err) == 0);
  CHECK(has(out, std::string("sparkctl ") + kVersion + "\n"));
  CHECK(has(out, "CUDA driver: "));
  CHECK(has(out, "NCCL: "));
  if (dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) == nullptr) CHECK(has(out, "no GPU driver"));

  REQUIRE(run_cli({"version", "--short"}, &out, &err) == 0);
  CHECK_FALSE(has(out, "CUDA driver"));
  REQUIRE(run_cli({"--version"}, &out, &err) == 0);
  CHECK(has(out, std::string("sparkctl ") + kVersion));
  CHECK_FALSE(has(out, "NCCL"));
  CHECK(run_cli({"version", "--bogus"}, &out, &err) != 0);
}

TEST_CASE("the text report names devices, failed queries and holders from a report") {
  cli::VersionReport r;
  r.sparkctl = "9.9.9";
  r.built_with_cuda = true;
  r.cuda_runtime = "13.0";
  r.cuda_architectures = "90,121";
  r.probed = true;
  r.gpu.driver_loaded = true;
  r.gpu.driver_initialized = true;
  r.gpu.driver_api_version = 13000;
  r.gpu.kernel_module_version = "580.95.05";
  r.gpu.driver_library = "/usr/lib/x86_64-linux-gnu/libcuda.so.1";
  env::GpuDevice d;
  d.name = "NVIDIA H200";
  d.cc_major = 9;
  d.total_memory = 150ull << 30;
  d.max_smem_per_block_optin = 232448;
  d.multiprocessors = 132;
  d.errors.push_back("cuDeviceGetPCIBusId: CUDA_ERROR_INVALID_VALUE");
  r.gpu.devices.push_back(d);
  r.gpu.nccl_loaded = true;
  r.gpu.nccl_version_code = 22703;
  r.gpu.nccl_library = "/usr/lib/libnccl.so.2";
  r.gpu.holders.push_back({4242, "python3", {"/dev/nvidia0"}});
  std::ostringstream o;
  cli::print_version(o, r, 0);
  const std::string s = o.str();
  CHECK(has(s, "build: CUDA runtime 13.0 (static), kernels for sm_90, sm_121\n"));
  CHECK(has(
      s, "CUDA driver: 13.0, kernel module 580.95.05 (/usr/lib/x86_64-linux-gnu/libcuda.so.1)\n"));
  CHECK(has(s, "GPU 0: NVIDIA H200, compute capability 9.0, "));
  CHECK(has(s, "227 KiB shared/block (opt-in), 132 SMs\n"));
  CHECK(has(s, "  query failed: cuDeviceGetPCIBusId"));
  CHECK(has(s, "NCCL: 2.27.3 (/usr/lib/libnccl.so.2)\n"));
  CHECK(has(s, "GPU held by pid 4242 (python3): /dev/nvidia0\n"));
  auto j = cli::to_json(r);
  CHECK(j["gpu"]["devices"][0]["max_shared_memory_per_block_optin_bytes"] == 232448);
  CHECK(j["gpu"]["nccl"]["version"] == "2.27.3");
  // What DEVICE=auto and WEIGHTS_PLACEMENT=auto pick: an H200 keeps the weights in its
  // memory; a GB10 (integrated, unified memory) reads them in place.
  r.cuda_architectures = "90a,121a";
  CHECK(cli::engine_device_for(r) == "cuda: GPU 0 (NVIDIA H200, sm_90); weights in device memory");
  r.gpu.devices[0].name = "NVIDIA GB10";
  r.gpu.devices[0].cc_major = 12;
  r.gpu.devices[0].cc_minor = 1;
  r.gpu.devices[0].integrated = true;
  CHECK(cli::engine_device_for(r) ==
        "cuda: GPU 0 (NVIDIA GB10, sm_121); weights host-mapped (unified memory)");
}
