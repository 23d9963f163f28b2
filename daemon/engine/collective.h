#pragma once
// The collective operations tensor parallelism needs, behind one interface: the CPU path
// uses Gloo over TCP (gloo_collective.h), a single process uses LocalCollective, and the
// CUDA path adds NCCL. Every call has a deadline; a failure names the rank.
#include <cstddef>
#include <memory>

#include "core/error.h"

namespace spark::engine {

class Collective {
 public:
  virtual ~Collective() = default;
  /// This process's rank in [0, world_size()).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Sums `n` floats elementwise across all ranks; every rank ends with the sum.
  virtual Status all_reduce_sum(float* data, size_t n) = 0;
  /// Copies `bytes` bytes from rank `root`'s buffer into everyone's.
  virtual Status broadcast(void* data, size_t bytes, int root) = 0;
  /// Returns when every rank has called barrier().
  virtual Status barrier() = 0;
};

/// World of one: all_reduce/broadcast/barrier are no-ops.
class LocalCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status all_reduce_sum(float*, size_t) override { return Status::Ok(); }
  Status broadcast(void*, size_t, int) override { return Status::Ok(); }
  Status barrier() override { return Status::Ok(); }
};

}  // namespace spark::engine
