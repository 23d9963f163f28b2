// Hardware tier, GPU: the probe and the kernels on a real device. Each test prints
// "SKIP: <reason>" and returns where no CUDA device is usable.
#include "env/gpu.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "kernels/rmsnorm.h"
#include "support/gpu.h"

using namespace spark;

TEST_CASE("hw: the driver probe and the CUDA runtime see the same devices") {
  if (test::skip_without_cuda()) return;
  env::GpuReport r = env::probe_gpu();
  std::cout << "# probe: " << env::to_json(r).dump() << "\n";
  REQUIRE_MESSAGE(r.has_gpu(), r.driver_reason);
  CHECK(r.driver_reason.empty());
  CHECK(static_cast<int>(r.devices.size()) == *kernels::cuda_device_count());
  CHECK(r.driver_api_version >= 12000);
  for (const auto& d : r.devices) {
    CAPTURE(d.index);
    CHECK_FALSE(d.name.empty());
    CHECK(d.cc_major >= 7);
    CHECK(d.total_memory > (1ull << 30));
    CHECK(d.max_smem_per_block_optin >= 48 * 1024);
    CHECK(d.multiprocessors > 0);
    CHECK(d.errors.empty());
  }
  if (r.nccl_loaded) {
    CHECK(r.nccl_version_code >= 20000);
  } else {
    std::cout << "# NCCL not found: " << r.nccl_reason << "\n";
  }
}

TEST_CASE("hw: RMSNorm at LLM shapes matches the reference; bandwidth is reported") {
  if (test::skip_without_cuda()) return;
  struct Shape {
    size_t rows, dim;
  } shapes[] = {{1, 4096}, {128, 5120}, {2048, 8192}, {4096, 7168}};
  std::printf("# %-6s %-6s %-12s %-10s %-7s\n", "rows", "dim", "max_abs_diff", "GB/s", "#wrong");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& sh : shapes) {
    const size_t n = sh.rows * sh.dim;
    auto x = test::seeded_floats(n, 11u, -3, 3);
    auto w = test::seeded_floats(sh.dim, 12u, 0.5f, 1.5f);
    std::vector<float> ref(n), got(n, NAN);
    kernels::rmsnorm_ref(x.data(), w.data(), ref.data(), sh.rows, sh.dim, 1e-5f);
    auto dx = kernels::DeviceMemory::allocate(n * 4),
         dw = kernels::DeviceMemory::allocate(sh.dim * 4),
         dy = kernels::DeviceMemory::allocate(n * 4);
    REQUIRE((dx.ok() && dw.ok() && dy.ok()));
    REQUIRE(dx->copy_from_host(x.data(), n * 4).ok());
    REQUIRE(dw->copy_from_host(w.data(), sh.dim * 4).ok());
    auto launch = [&] {
      return kernels::rmsnorm_cuda_device(
          static_cast<const float*>(dx->get()), static_cast<const float*>(dw->get()),
          static_cast<float*>(dy->get()), sh.rows, sh.dim, 1e-5f, nullptr);
    };
    REQUIRE(launch().ok());  // warm-up
    REQUIRE(kernels::cuda_synchronize().ok());
    const int iters = 20;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) REQUIRE(launch().ok());
    REQUIRE(kernels::cuda_synchronize().ok());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
    REQUIRE(dy->copy_to_host(got.data(), n * 4).ok());
    double max_diff = 0;
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
      if (!(d <= 1e-5)) ++wrong;
      if (d > max_diff) max_diff = d;
    }
    double gbps = 2.0 * n * 4 / s / 1e9;  // read x, write y
    std::printf("  %-6zu %-6zu %-12.3g %-10.1f %-7zu\n", sh.rows, sh.dim, max_diff, gbps, wrong);
    rows.push_back({{"rows", sh.rows},
                    {"dim", sh.dim},
                    {"max_abs_diff", max_diff},
                    {"gb_per_s", gbps},
                    {"wrong", wrong}});
    CHECK(wrong == 0);
  }
  std::cout << "# json: " << nlohmann::json{{"rmsnorm_fp32", rows}}.dump() << "\n";
}

TEST_CASE("hw: a process holding /dev/nvidiactl is listed as a GPU holder; the prober is not") {
  if (access("/dev/nvidiactl", R_OK) != 0) {
    std::cout << "SKIP: /dev/nvidiactl is not readable here (no NVIDIA driver)\n";
    MESSAGE("SKIP: no /dev/nvidiactl");
    return;
  }
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // No CUDA here (the parent may have initialised it): just hold the device file.
    int fd = open("/dev/nvidiactl", O_RDONLY);
    char c = fd >= 0 ? 'y' : 'n';
    (void)!write(ready[1], &c, 1);
    sleep(20);  // bounded; the parent kills us sooner
    _exit(0);
  }
  close(ready[1]);
  char c = 0;
  REQUIRE(read(ready[0], &c, 1) == 1);
  close(ready[0]);
  int unreadable = 0;
  auto holders = env::find_gpu_holders("/", getpid(), &unreadable);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  REQUIRE(c == 'y');
  bool found = false;
  for (const auto& h : holders) {
    CHECK(h.pid != getpid());
    if (h.pid == child) {
      found = true;
      // The child also inherits whatever device files this process had open (CUDA opens
      // /dev/nvidia0, /dev/nvidia-uvm, ...), so nvidiactl must be among them, not alone.
      CHECK(std::find(h.devices.begin(), h.devices.end(), "/dev/nvidiactl") != h.devices.end());
    }
  }
  CHECK(found);
}
