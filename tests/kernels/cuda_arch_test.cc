// Which GPUs a build runs on and which paths it takes there, without a GPU: the pure
// functions over a compute capability and the compiled architecture list.
#include <doctest/doctest.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda_runtime.h"
#include "kernels/launch.h"

using namespace spark::kernels;

namespace {

DeviceLimits gpu(const char* name, int major, int minor) {
  DeviceLimits d;
  d.name = name;
  d.cc_major = major;
  d.cc_minor = minor;
  return d;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("cuda architectures: the list parses as CMake writes it") {
  CHECK(parse_cuda_architectures("80,86,89,90a,120,121a") ==
        std::vector<int>{80, 86, 89, 90, 120, 121});
  CHECK(parse_cuda_architectures("90-real;121a") == std::vector<int>{90, 121});
  CHECK(parse_cuda_architectures("native").empty());
  CHECK(parse_cuda_architectures("").empty());
}

TEST_CASE("cuda architectures: each GPU of the default list runs, others are refused clearly") {
  const std::string def = "80,86,89,90a,120,121a";
  for (auto g : {std::tuple{"NVIDIA A100-SXM4-80GB", 8, 0}, std::tuple{"NVIDIA A10", 8, 6},
                 std::tuple{"NVIDIA L40S", 8, 9}, std::tuple{"NVIDIA H200", 9, 0},
                 std::tuple{"NVIDIA GeForce RTX 5090", 12, 0}, std::tuple{"NVIDIA GB10", 12, 1}}) {
    const char* name = std::get<0>(g);
    CHECK_MESSAGE(cuda_arch_problem(gpu(name, std::get<1>(g), std::get<2>(g)), def).empty(), name);
  }

  // A GPU the build has no kernels for: its name, sm, the list and the rebuild.
  const std::string p = cuda_arch_problem(gpu("NVIDIA L40S", 8, 9), "121a");
  CHECK(has(p, "sm_89 (NVIDIA L40S, device 0)"));
  CHECK(has(p, "(121a)"));
  CHECK(has(p, "-DCMAKE_CUDA_ARCHITECTURES=\"121a;89\""));
  CHECK(has(p, "DEVICE=cpu"));
  CHECK(has(cuda_arch_problem(gpu("NVIDIA B200", 10, 0), def),
            "-DCMAKE_CUDA_ARCHITECTURES=\"80;86;89;90a;120;121a;100\""));

  // Older than sm_80: no rebuild helps, the CPU does.
  const std::string old = cuda_arch_problem(gpu("Tesla T4", 7, 5), "75," + def);
  CHECK(has(old, "sm_75 (Tesla T4, device 0) is older than sm_80"));
  CHECK(has(old, "DEVICE=cpu"));

  // A list without numbers ("native") leaves it to the kernel-image probe.
  CHECK(cuda_arch_problem(gpu("NVIDIA A100", 8, 0), "native").empty());
}

TEST_CASE("cuda architectures: the sm_90 paths run from sm_90 on unless the fallbacks are forced") {
  CHECK_FALSE(cuda_hopper_paths(8, false));  // A100, L40S: no clusters, no dependent launch
  CHECK(cuda_hopper_paths(9, false));
  CHECK(cuda_hopper_paths(12, false));
  CHECK_FALSE(cuda_hopper_paths(9, true));  // SPARK_CUDA_FALLBACKS=1
  CHECK_FALSE(cuda_hopper_paths(12, true));
  CHECK_FALSE(cuda_fallbacks());  // off by default
  set_cuda_fallbacks(true);
  CHECK(cuda_fallbacks());
  set_cuda_fallbacks(false);
  CHECK_FALSE(cuda_fallbacks());
}
