#pragma once
// Rendezvous: rank 0 serves a small TCP store on its fabric address (RDZV_PORT). Every rank
// registers its identity (version, config digest, model manifest digest); a mismatch is
// refused naming the rank and the field. Barriers have deadlines and name the ranks that did
// not arrive. Opaque blobs (the NCCL unique id) are published by one rank and read by the
// others. Followers keep a heartbeat connection to rank 0: a closed connection or silence
// past HEARTBEAT_TIMEOUT marks the rank dead.
//
// Wire protocol (one JSON object per line, one reply line per request, in order):
//   {"op":"join","identity":{rank,world_size,node,host,pid,version,config_digest,model_digest}}
//   {"op":"barrier","name":N,"rank":R,"timeout_ms":T}   -> reply once all ranks arrived
//   {"op":"set","key":K,"value":V}
//   {"op":"get","key":K,"timeout_ms":T}                 -> reply once K is set
//   {"op":"heartbeat","rank":R,"state":S,"reason":W,"slots_total":N,"slots_busy":N,
//    "device":D,"mem_available":BYTES}
// Replies: {"ok":true,...} or {"ok":false,"error":{"code":errc_name,"message":...}}.
// A heartbeat reply carries {"ring":{"state":S,"reason":W}} so followers see a fatal ring.
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "daemon/health.h"

namespace boost::asio {
class io_context;
}

namespace spark::daemon {

/// What each rank registers; every field but rank/node/host/pid must equal rank 0's.
struct RankIdentity {
  int rank = 0;
  int world_size = 1;
  std::string node;
  std::string host;
  int pid = 0;
  std::string version;
  std::string config_digest;
  std::string model_digest;  // may be empty until the model manifest exists
};
nlohmann::json to_json(const RankIdentity& id);
RankIdentity identity_from_json(const nlohmann::json& j);

/// Compares a joining rank with rank 0: the first differing field as an Errc::integrity
/// error naming the rank, its node, the field and both values; ok when they agree.
Status compare_identity(const RankIdentity& reference, const RankIdentity& joining);

/// Rank 0's store. Runs on the given reactor; never blocks it.
class RendezvousServer {
 public:
  /// `node_of_rank[i]` names rank i's node for messages.
  RendezvousServer(boost::asio::io_context& io, RankIdentity reference,
                   std::vector<std::string> node_of_rank,
                   std::chrono::milliseconds heartbeat_timeout);
  ~RendezvousServer();
  /// Binds and accepts. Errc::network naming address:port on failure.
  Status listen(const std::string& bind, uint16_t port);
  uint16_t port() const;
  /// Closes the listener and every connection (call before the reactor stops; thread-safe).
  void close();

  /// Per-rank view for /health (thread-safe). Rank 0's own entry is filled by the caller.
  std::vector<RankHealth> ranks() const;
  /// The first problem with the followers (dead after joining, refused at join, reported
  /// fatal or stalled), or nullopt. Thread-safe.
  struct Problem {
    State state = State::fatal;
    std::string reason;
  };
  std::optional<Problem> problem() const;
  /// True when every follower joined, is alive and reports ready.
  bool followers_ready(std::string* why) const;
  /// The ring state rank 0 hands to followers in heartbeat replies.
  void set_ring_state(State s, const std::string& reason);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// A rank's blocking client (runs on the lifecycle or heartbeat thread, never a reactor).
class RendezvousClient {
 public:
  RendezvousClient(std::string host, uint16_t port, std::string who);
  ~RendezvousClient();
  /// Connects, retrying until `deadline` passes (rank 0 may start later); the error names
  /// rank 0's address.
  Status connect(std::chrono::milliseconds deadline);
  /// Sends one request and waits for its reply up to `timeout`. A reply with ok:false comes
  /// back as its Error.
  Result<nlohmann::json> call(const nlohmann::json& request, std::chrono::milliseconds timeout);
  void close();
  /// Makes a connect() or call() in progress on another thread return at once (and every
  /// later one fail). Thread-safe.
  void abort();

  /// Convenience wrappers.
  Status join(const RankIdentity& id, std::chrono::milliseconds timeout);
  Status barrier(const std::string& name, int rank, std::chrono::milliseconds timeout);
  Status set(const std::string& key, const std::string& value);
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace spark::daemon
