#pragma once
// The collective operations tensor parallelism needs, behind one interface: the CPU path
// uses Gloo over TCP (gloo_collective.h), a single process uses LocalCollective, and the
// CUDA path uses NCCL (nccl_collective.h). The host calls carry the control plane (step
// plan, heartbeats) and the CPU path's activations; the device calls carry the GPU path's
// activations. Every call has a deadline; a failure names the rank.
#include <cstddef>
#include <memory>

#include "core/error.h"
#include "daemon/engine/safetensors.h"
#include "kernels/device_copy.h"

namespace spark::engine {

// A device collective's element type is the engine's one DType (safetensors.h): DType::f32
// and DType::bf16 (and f16) are reduced and gathered; any other is Errc::unsupported.

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

  /// Sums `count` elements of device memory in place across all ranks, enqueued on the CUDA
  /// stream `stream` (a cudaStream_t; nullptr: the default stream) without waiting for it.
  /// Capturable in a CUDA graph when every rank captures the same sequence of calls.
  /// Errc::unsupported where this collective has no device path (Gloo).
  virtual Status all_reduce_sum_device(void* data, size_t count, DType dtype, void* stream) {
    (void)data, (void)count, (void)dtype, (void)stream;
    return make_error(Errc::unsupported,
                      "all_reduce_sum_device: this collective has no device path");
  }
  /// Gathers `count_per_rank` elements of device memory from every rank into `out`
  /// (world_size() * count_per_rank elements, rank r's at offset r * count_per_rank),
  /// enqueued on `stream` like all_reduce_sum_device, and capturable the same way.
  virtual Status all_gather_device(const void* in, void* out, size_t count_per_rank, DType dtype,
                                   void* stream) {
    (void)in, (void)out, (void)count_per_rank, (void)dtype, (void)stream;
    return make_error(Errc::unsupported, "all_gather_device: this collective has no device path");
  }
};

/// World of one: the reductions, broadcast and barrier are no-ops; all_gather_device is one
/// device copy on the stream (none when `in` == `out`).
class LocalCollective final : public Collective {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status all_reduce_sum(float*, size_t) override { return Status::Ok(); }
  Status broadcast(void*, size_t, int) override { return Status::Ok(); }
  Status barrier() override { return Status::Ok(); }
  Status all_reduce_sum_device(void*, size_t, DType, void*) override { return Status::Ok(); }
  Status all_gather_device(const void* in, void* out, size_t count_per_rank, DType dtype,
                           void* stream) override {
    if (in == out || count_per_rank == 0) return Status::Ok();
    return kernels::device_copy_async(out, in, count_per_rank * dtype_size(dtype), stream);
  }
};

}  // namespace spark::engine
