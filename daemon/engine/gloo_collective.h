#pragma once
// Collective over Gloo's TCP transport for the CPU tensor-parallel path and the control plane
// of the GPU path. The ranks meet through a RendezvousStore (sparkd's rendezvous), or else
// rank 0 serves a TCP store (tcp_store.h); every rank binds its Gloo device to its own address,
// publishes it through the store, and connects a full mesh. After connecting, an
// all_reduce of the ranks checks the mesh really carries data before it is trusted.
#include <functional>
#include <memory>
#include <string>

#include "daemon/engine/collective.h"
#include "daemon/engine/rendezvous_store.h"

namespace spark::engine {

struct GlooOptions {
  int rank = 0;
  int world = 1;
  std::string store_host = "127.0.0.1";  // where rank 0 serves the rendezvous store
  int store_port = 0;                    // rank 0 may pass 0 and read GlooCollective::store_port()
  std::string bind_host = "127.0.0.1";   // this rank's address for Gloo traffic (its fabric IP)
  std::string prefix = "sparkd";         // key namespace, e.g. a ring generation
  int timeout_ms = 30000;                // every collective operation
  int rendezvous_timeout_ms = 0;         // waiting for the other ranks to join; 0: timeout_ms
  /// When set, the mesh addresses go through this store (sparkd: its rendezvous) and no
  /// TCP store is started or dialled; store_host/store_port are then unused.
  std::shared_ptr<RendezvousStore> store;
  /// Names the ranks the daemon's heartbeats find missing ("rank 1 (spark-b): heartbeat
  /// silent 6 s"), added to a failed operation's message; "" when it knows of none. Optional.
  std::function<std::string()> missing_ranks;
};

class GlooCollective final : public Collective {
 public:
  /// Rendezvous + full-mesh connect + a checked all_reduce; every step has a deadline.
  /// Sets SIGPIPE to ignored for the process: a vanished peer must fail an operation with a
  /// message, not kill this rank.
  static Result<std::shared_ptr<GlooCollective>> connect(const GlooOptions& opts);
  ~GlooCollective() override;
  int rank() const override;
  int world_size() const override;
  Status all_reduce_sum(float* data, size_t n) override;
  Status broadcast(void* data, size_t bytes, int root) override;
  Status barrier() override;
  Status all_gather(const void* in, void* out, size_t bytes_per_rank) override;
  std::string address() const override;
  /// Closes the mesh's connections; every later operation fails with Errc::precondition.
  void shutdown() override;
  /// The store's port (rank 0; useful when it was started on port 0).
  int store_port() const;

  struct Impl;

 private:
  GlooCollective() = default;
  std::unique_ptr<Impl> impl_;
};

/// Rank 0 can start the store first to learn a free port before spawning other ranks.
/// Returns an opaque handle kept alive by the caller; connect() then uses store_port.
class TcpStoreServer;
Result<std::shared_ptr<TcpStoreServer>> start_rendezvous_store(const std::string& host, int port);

}  // namespace spark::engine
