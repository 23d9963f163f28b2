// The fabric check's C++ twins, and its device entry points in a build without CUDA.
#include <utility>

#include "kernels/fabric_check.h"

namespace spark::kernels {

void fabric_fill_ref(float* buf, size_t count, int rank, uint64_t seed) {
  for (size_t i = 0; i < count; ++i) buf[i] = fabric_value(seed, rank, i);
}

uint64_t fabric_wrong_allreduce_ref(const float* buf, size_t count, int world, uint64_t seed) {
  uint64_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    float want = 0;
    for (int r = 0; r < world; ++r) want += fabric_value(seed, r, i);
    wrong += buf[i] != want;
  }
  return wrong;
}

uint64_t fabric_wrong_allgather_ref(const float* buf, size_t count_per_rank, int world,
                                    uint64_t seed) {
  uint64_t wrong = 0;
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < count_per_rank; ++i)
      wrong += buf[static_cast<size_t>(r) * count_per_rank + i] != fabric_value(seed, r, i);
  return wrong;
}

#if !defined(SPARK_HAVE_CUDA)
namespace {
Error no_cuda(const char* what) {
  return make_error(Errc::unsupported,
                    std::string(what) +
                        ": built without CUDA (nvcc was not found at configure time; "
                        "reconfigure with CUDA installed and SPARK_CUDA=ON)");
}
}  // namespace

Status fabric_fill_device(float*, size_t, int, uint64_t, void*) {
  return no_cuda("fabric_fill_device");
}
Status fabric_count_wrong_allreduce_device(const float*, size_t, int, uint64_t, unsigned long long*,
                                           void*) {
  return no_cuda("fabric_count_wrong_allreduce_device");
}
Status fabric_count_wrong_allgather_device(const float*, size_t, int, uint64_t, unsigned long long*,
                                           void*) {
  return no_cuda("fabric_count_wrong_allgather_device");
}
Result<StreamTimer> StreamTimer::create() {
  return no_cuda("StreamTimer");
}
StreamTimer& StreamTimer::operator=(StreamTimer&& o) noexcept {
  std::swap(a_, o.a_), std::swap(b_, o.b_);
  return *this;
}
StreamTimer::~StreamTimer() = default;
Status StreamTimer::start(void*) {
  return no_cuda("StreamTimer::start");
}
Status StreamTimer::stop(void*) {
  return no_cuda("StreamTimer::stop");
}
Result<double> StreamTimer::elapsed_ms() const {
  return no_cuda("StreamTimer::elapsed_ms");
}
#endif

}  // namespace spark::kernels
