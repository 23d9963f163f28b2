#pragma once
// The collective operations tensor parallelism needs, behind one interface: the CPU path
// uses Gloo over TCP (gloo_collective.h), a single process uses LocalCollective, and the
// CUDA path uses NCCL (nccl_collective.h). The host calls carry the control plane (step
// plan, heartbeats) and the CPU path's activations; the device calls carry the GPU path's
// activations. Every call has a deadline; a failure names the rank.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

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
  /// Gathers `bytes_per_rank` bytes from every rank into `out` (world_size() *
  /// bytes_per_rank bytes, rank r's at offset r * bytes_per_rank). The default takes one
  /// broadcast per rank; a transport with a real all-gather overrides it.
  virtual Status all_gather(const void* in, void* out, size_t bytes_per_rank);

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
  /// True when the device calls may be recorded in a CUDA graph (NCCL, one rank); false
  /// where they wait on the host (a host-staged collective), so decode steps run eagerly.
  virtual bool device_calls_capturable() const { return false; }
  /// The host address this rank's transport listens on (where the other ranks reach it:
  /// Gloo's bind address); "" when it has none (one rank). The control plane listens there.
  virtual std::string address() const { return {}; }
  /// Leaves the ring after a fatal error on this rank: drops the connections so the other
  /// ranks' operations fail at once instead of at their deadline. No call may follow.
  virtual void shutdown() {}
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
  Status all_gather(const void* in, void* out, size_t bytes_per_rank) override;
  Status all_reduce_sum_device(void*, size_t, DType, void*) override { return Status::Ok(); }
  Status all_gather_device(const void* in, void* out, size_t count_per_rank, DType dtype,
                           void* stream) override {
    if (in == out || count_per_rank == 0) return Status::Ok();
    return kernels::device_copy_async(out, in, count_per_rank * dtype_size(dtype), stream);
  }
  bool device_calls_capturable() const override { return true; }
};

/// The device calls of a host collective (Gloo) for a GPU rank, staged through page-locked
/// host memory: each call waits for the stream, copies the data to the host, runs the host
/// collective (bf16 summed in fp32) and copies the result back. It lets several ranks share
/// one GPU (NCCL refuses two ranks on one device) and serves rings without NCCL; it cannot
/// be captured in a CUDA graph (it waits on the host), so decode steps run eagerly over it.
/// The host calls go straight to `host`.
class HostStagedCollective final : public Collective {
 public:
  explicit HostStagedCollective(std::shared_ptr<Collective> host);
  ~HostStagedCollective() override;
  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  Status all_reduce_sum(float* data, size_t n) override { return host_->all_reduce_sum(data, n); }
  Status broadcast(void* data, size_t bytes, int root) override {
    return host_->broadcast(data, bytes, root);
  }
  Status barrier() override { return host_->barrier(); }
  Status all_gather(const void* in, void* out, size_t bytes_per_rank) override {
    return host_->all_gather(in, out, bytes_per_rank);
  }
  Status all_reduce_sum_device(void* data, size_t count, DType dtype, void* stream) override;
  Status all_gather_device(const void* in, void* out, size_t count_per_rank, DType dtype,
                           void* stream) override;
  bool device_calls_capturable() const override { return false; }
  std::string address() const override { return host_->address(); }
  void shutdown() override { host_->shutdown(); }

 private:
  Status stage(size_t bytes);  // grows the page-locked buffer to `bytes`
  std::shared_ptr<Collective> host_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  std::vector<float> wide_;
};

}  // namespace spark::engine
