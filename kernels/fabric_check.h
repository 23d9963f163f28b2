#pragma once
// The fabric self-test's device side: buffers filled with seeded values by a kernel, and the
// result of an all-reduce or all-gather checked against the values every rank must have
// contributed, on the device, as a count of wrong elements (nccl-tests' #wrong). The values
// are small integers, so sums over any number of ranks are exact in fp32 and a check needs
// no tolerance. Each function has a plain C++ twin (the *_ref functions) that the tests
// compare against, and a CUDA-event timer for the sweep. In a build without CUDA the device
// calls return Errc::unsupported.
#include <cstddef>
#include <cstdint>

#include "core/error.h"

#if defined(__CUDACC__)
#define SPARK_FABRIC_HD __host__ __device__
#else
#define SPARK_FABRIC_HD
#endif

namespace spark::kernels {

/// The value rank `rank` contributes at element `i` for `seed`: an integer in [-32, 32].
SPARK_FABRIC_HD inline float fabric_value(uint64_t seed, int rank, uint64_t i) {
  uint64_t z =
      seed + 0x9e3779b97f4a7c15ull * (static_cast<uint64_t>(rank) + 1) + i * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int>(z % 65) - 32);
}

/// buf[i] = fabric_value(seed, rank, i) for i < count.
void fabric_fill_ref(float* buf, size_t count, int rank, uint64_t seed);
/// Elements of an all-reduce (sum) result that differ from the sum of every rank's values.
uint64_t fabric_wrong_allreduce_ref(const float* buf, size_t count, int world, uint64_t seed);
/// Elements of an all-gather result (rank r's values at r * count_per_rank) that are wrong.
uint64_t fabric_wrong_allgather_ref(const float* buf, size_t count_per_rank, int world,
                                    uint64_t seed);

/// The device twin of fabric_fill_ref, enqueued on `stream` (a cudaStream_t).
Status fabric_fill_device(float* buf, size_t count, int rank, uint64_t seed, void* stream);
/// Adds the wrong elements of an all-reduce result to the device counter `*wrong`.
Status fabric_count_wrong_allreduce_device(const float* buf, size_t count, int world, uint64_t seed,
                                           unsigned long long* wrong, void* stream);
/// Adds the wrong elements of an all-gather result to the device counter `*wrong`.
Status fabric_count_wrong_allgather_device(const float* buf, size_t count_per_rank, int world,
                                           uint64_t seed, unsigned long long* wrong, void* stream);

/// Two CUDA events around work on one stream: the device's own time for that work.
class StreamTimer {
 public:
  /// Errc::unsupported without CUDA.
  static Result<StreamTimer> create();
  StreamTimer() = default;
  StreamTimer(StreamTimer&& o) noexcept : a_(o.a_), b_(o.b_) { o.a_ = o.b_ = nullptr; }
  StreamTimer& operator=(StreamTimer&& o) noexcept;
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  ~StreamTimer();
  /// Records the start (resp. stop) event on `stream`.
  Status start(void* stream);
  Status stop(void* stream);
  /// Milliseconds between the two events; the stop event must have completed.
  Result<double> elapsed_ms() const;

 private:
  void* a_ = nullptr;
  void* b_ = nullptr;
};

}  // namespace spark::kernels
