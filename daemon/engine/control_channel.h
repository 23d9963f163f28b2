#pragma once
// The transport of the tensor-parallel control plane: one TCP connection from each rank
// > 0 to rank 0, opened when the engine starts (rank 0 listens on the data collective's
// address and tells the others its port through that collective). Rank 0 writes framed
// messages (a u32 length, then the bytes: step plans and heartbeats) to every follower; a
// follower reads them and may send one report back, its reason for leaving the ring (a
// divergence), which rank 0 then names in its own error.
//
// Why not the data collective: a Gloo or NCCL broadcast is a rendezvous (the receiver
// must be in the call), so the plan of step N+1 could not be on its way while step N
// computes. A socket buffers it: rank 0 writes the plan of step N+1 before it starts step
// N, and a follower that finishes step N finds it already there (poll() says so, which
// the engine counts). Rank 0's writes never wait for a follower in the middle of a step: a
// plan larger than the socket buffer is finished by the next post(), flush() or keepalive.
// Every wait has a deadline and names the rank it waited for.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "daemon/engine/collective.h"

namespace spark::engine {

class ControlChannel {
 public:
  /// Rank 0 listens and accepts world - 1 connections; the others connect. Collective (on
  /// `comm`): every rank calls it after the same collectives. `timeout` bounds every wait.
  /// `socket_buffer` > 0: rank 0's SO_SNDBUF and the others' SO_RCVBUF (a test seam:
  /// small, it makes a long plan's post partial).
  static Result<std::unique_ptr<ControlChannel>> connect(Collective& comm,
                                                         std::chrono::milliseconds timeout,
                                                         int socket_buffer = 0);
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // Rank 0.
  /// Sends `msg` to every follower. With `wait` it returns once every byte is written;
  /// without, it writes what the sockets take now and leaves the rest to the next call.
  /// A report a follower sent back, or a closed connection, fails it, naming the rank.
  Status post(const std::string& msg, bool wait);
  /// Writes whatever post() left, waiting up to the deadline.
  Status flush();
  /// True when post() left bytes unwritten.
  bool pending() const;
  /// Posts that left bytes for a later write, so far.
  uint64_t deferred_posts() const { return deferred_; }
  /// The reports followers sent back ("rank N: ..."; "" none), reading for up to `grace`:
  /// after a failed step, the reason a follower gave for leaving.
  std::string reports(std::chrono::milliseconds grace);

  // Ranks > 0.
  /// The next message from rank 0, waiting up to the deadline; `*arrived` tells whether it
  /// was already there when called (the engine's count of plans that cost no wait).
  Result<std::string> next(bool* arrived);
  /// Tells rank 0 why this rank leaves the ring (best effort: it may be gone).
  void report(const std::string& why);

  /// Closes every connection (the peers' next read or write fails).
  void close();
  int rank() const { return rank_; }

 private:
  ControlChannel() = default;
  Status write_some(int peer, bool wait);
  std::string read_report(int peer, int timeout_ms);
  int rank_ = 0, world_ = 1;
  int timeout_ms_ = 30000;
  std::vector<int> fds_;          // rank 0: per rank (-1 for itself); others: [0] to rank 0
  std::vector<std::string> out_;  // rank 0: bytes not yet written, per rank
  std::vector<size_t> sent_;      // rank 0: how much of out_ is written
  uint64_t deferred_ = 0;
};

}  // namespace spark::engine
