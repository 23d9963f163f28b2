#pragma once
// The GPU path's collective: activations over NCCL on device pointers in the compute stream
// (capturable in CUDA graphs), the control plane (step plan, heartbeats, barriers) on a host
// collective (Gloo over TCP, or LocalCollective for one rank). The communicator is created
// non-blocking, so every wait polls ncclCommGetAsyncError against a deadline: on an error or
// a timeout the communicator is aborted (ncclCommAbort) and the call, and every later one,
// fails with a message that names this rank, what it waited for, and (from the host
// control plane) which rank did not arrive. abort() does the same from another thread, e.g.
// when the daemon's heartbeats find a rank dead while a step is in flight.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "daemon/engine/collective.h"
#include "daemon/engine/nccl_lib.h"

namespace spark::engine {

struct NcclOptions {
  int rank = 0;
  int world = 1;
  std::string library = nccl::default_library();
  std::chrono::milliseconds init_timeout{120000};  // ncclCommInitRank (first use tunes links)
  std::chrono::milliseconds op_timeout{30000};     // each synchronize()
  /// Names the ranks the control plane finds missing ("rank 1 (spark-b): heartbeat silent
  /// 6 s"), for the message of a wait that timed out; "" when it knows of none. Optional.
  std::function<std::string()> missing_ranks;
};

/// The unique id as 256 hex characters, for the rendezvous (whose values are text).
std::string nccl_id_to_hex(const nccl::UniqueId& id);
/// The inverse; Errc::integrity when `hex` is not 256 hex characters.
Result<nccl::UniqueId> nccl_id_from_hex(const std::string& hex);

class NcclCollective final : public Collective {
 public:
  /// A fresh unique id (rank 0 calls this and hands the id to the others).
  static Result<nccl::UniqueId> new_unique_id(const std::string& library);
  /// Joins the communicator of `id` as opts.rank of opts.world (the current CUDA device),
  /// within opts.init_timeout; host calls go to `host`, whose rank and world must match.
  static Result<std::shared_ptr<NcclCollective>> connect(const NcclOptions& opts,
                                                         const nccl::UniqueId& id,
                                                         std::shared_ptr<Collective> host);
  /// Rank 0 makes the id and publishes it with `share` (the daemon's rendezvous: rank 0
  /// passes its value, the others receive it), then every rank connects.
  using ShareFn = std::function<Result<std::string>(const std::string&, const std::string&)>;
  static Result<std::shared_ptr<NcclCollective>> connect_via(const NcclOptions& opts,
                                                             const ShareFn& share,
                                                             std::shared_ptr<Collective> host);
  ~NcclCollective() override;

  int rank() const override { return opts_.rank; }
  int world_size() const override { return opts_.world; }
  Status all_reduce_sum(float* data, size_t n) override;
  Status broadcast(void* data, size_t bytes, int root) override;
  Status barrier() override;
  Status all_gather(const void* in, void* out, size_t bytes_per_rank) override;
  bool device_calls_capturable() const override { return true; }
  std::string address() const override { return host_->address(); }
  /// Aborts the communicator and leaves the host collective's mesh.
  void shutdown() override {
    abort("this rank left the ring after a fatal error");
    host_->shutdown();
  }
  Status all_reduce_sum_device(void* data, size_t count, DType dtype, void* stream) override;
  Status all_gather_device(const void* in, void* out, size_t count_per_rank, DType dtype,
                           void* stream) override;
  /// Copies `count` elements from rank `root`'s device buffer into everyone's, on `stream`.
  Status broadcast_device(void* data, size_t count, DType dtype, int root, void* stream);
  /// Waits until the work enqueued on `stream` finished, polling the stream and NCCL's async
  /// error; on an error or after `timeout` (<= 0: opts.op_timeout) the communicator is
  /// aborted and the Error says which.
  Status synchronize(void* stream, std::chrono::milliseconds timeout = {});
  /// Aborts the communicator (thread-safe, idempotent): a wait in progress returns within a
  /// poll interval, and every later call fails with `why`.
  void abort(const std::string& why);
  /// Why this collective is unusable ("" while it is healthy).
  std::string failure() const;
  const nccl::Lib& lib() const { return *lib_; }

 private:
  NcclCollective() = default;
  Status check_usable() const;
  Error aborted_error() const;  // mu_ held
  // ncclCommGetAsyncError under mu_ (abort() may free the communicator from another thread).
  Result<nccl::Result_t> poll_async_error();
  std::string describe(nccl::Result_t r);
  // Waits while NCCL reports ncclInProgress for `what` (non-blocking init and enqueue).
  Status wait_in_progress(const std::string& what, std::chrono::milliseconds timeout);
  Status fail(Errc code, const std::string& what);
  std::string where() const;

  NcclOptions opts_;
  const nccl::Lib* lib_ = nullptr;
  nccl::Comm comm_ = nullptr;
  std::shared_ptr<Collective> host_;
  mutable std::mutex mu_;  // guards failure_ and the abort of comm_
  std::string failure_;
  std::atomic<bool> aborted_{false};
};

}  // namespace spark::engine
