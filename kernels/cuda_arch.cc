// Which GPUs a build's kernels run on: plain functions over a compute capability and the
// architecture list compiled in, so they are tested without a GPU.
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda_runtime.h"

namespace spark::kernels {

std::vector<int> parse_cuda_architectures(std::string_view list) {
  std::vector<int> out;
  size_t i = 0;
  while (i < list.size()) {
    size_t j = list.find_first_of(",;", i);
    if (j == std::string_view::npos) j = list.size();
    int v = 0;
    bool digits = false;
    for (size_t k = i; k < j && list[k] >= '0' && list[k] <= '9'; ++k)
      v = v * 10 + (list[k] - '0'), digits = true;
    if (digits) out.push_back(v);
    i = j + 1;
  }
  return out;
}

std::string cuda_arch_problem(const DeviceLimits& d, std::string_view compiled) {
  const int sm = d.cc_major * 10 + d.cc_minor;
  const std::string desc =
      "sm_" + std::to_string(sm) + " (" + d.name + ", device " + std::to_string(d.device) + ")";
  if (sm < kCudaMinSm)
    return desc + " is older than sm_" + std::to_string(kCudaMinSm) +
           ", the oldest GPU the kernels support (cp.async, bf16): set DEVICE=cpu to run on "
           "the CPU";
  const auto built = parse_cuda_architectures(compiled);
  if (built.empty()) return {};  // "native", "all": the kernel-image probe decides
  for (int b : built)
    if (b == sm) return {};
  std::string list(compiled);
  for (char& c : list)
    if (c == ',') c = ';';
  return desc + " is not among the GPUs this build has kernels for (" + std::string(compiled) +
         "): rebuild with -DCMAKE_CUDA_ARCHITECTURES=\"" + list + ";" + std::to_string(sm) +
         "\", or set DEVICE=cpu to run on the CPU";
}

bool cuda_hopper_paths(int cc_major, bool fallbacks) {
  return cc_major >= 9 && !fallbacks;
}

}  // namespace spark::kernels
