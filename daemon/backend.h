#pragma once
// The backends sparkd runs (ENGINE=native|exec) behind one interface. `native` is our own
// engine (daemon/engine/); `exec` runs a configured external command per rank and takes its
// health from that command's own endpoint. The daemon's lifecycle thread calls start(); the
// HTTP threads call status(), which must be cheap and thread-safe. Engine work never runs on
// the reactor.
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config.h"
#include "core/error.h"

namespace spark::daemon {

class HttpServer;
class Metrics;
class MemoryGuard;

/// What a backend reports about itself.
struct BackendStatus {
  bool ready = false;
  bool fatal = false;  // it will not get better (process exited, load failed)
  std::string reason;  // why not ready / why fatal
  int slots_total = 0;
  int slots_busy = 0;
  int requests_waiting = 0;
  /// Age of the oldest engine call still running (a forward step, a health poll); the
  /// daemon reports `stalled` when it passes STALL_TIMEOUT.
  std::chrono::milliseconds oldest_call{0};
  std::string oldest_call_what;  // what that call is, for the stalled reason
  /// The fabric self-test's report (engine/fabric_test.h to_json), shown in /health; null
  /// when it did not run.
  nlohmann::json fabric;
  /// Rank 0: every rank's fabric report (an array in rank order); null when none.
  nlohmann::json fabric_ranks;
  std::string device;       // what computes on this rank ("NVIDIA H200 ...", "cpu ...")
  std::string device_note;  // why DEVICE=auto fell back to the CPU
  /// What the engine serves (engine::Model::describe): architecture, parameters, experts and
  /// their split; null when the backend does not know (exec).
  nlohmann::json model_info;
};

/// What a backend starts with.
struct BackendContext {
  const RingConfig* cfg = nullptr;
  RankPlace place;
  int world_size = 1;
  std::string log_dir;  // where the engine may keep its own logs (exists)
  std::string pidfile;  // sparkd's pidfile ("" when none); exec writes <pidfile>.engine
  /// Variables for this rank (SPARK_RANK, SPARK_WORLD_SIZE, SPARK_MASTER_ADDR, ...); the exec
  /// backend adds them to the engine's environment.
  std::map<std::string, std::string> env;
  std::chrono::milliseconds stall_timeout{60000};
  Metrics* metrics = nullptr;
  /// Call admit() before taking a new request (blocks while memory is short) and register a
  /// cancel hook for the newest request. Null in tests that do not need it.
  MemoryGuard* memory_guard = nullptr;
  /// Exchanges an opaque blob through rendezvous (rank 0 publishes, others receive), e.g.
  /// the NCCL unique id. Null when the ring has one rank.
  std::function<Result<std::string>(const std::string& key, const std::string& value_if_rank0)>
      share;
  /// Waits at a named barrier until every rank arrives (deadline inside). Null: one rank.
  std::function<Status(const std::string& name)> barrier;
  /// The ring's key-value store (rank 0's rendezvous): set publishes, get waits for a key up
  /// to its timeout. The engine's own meshes (Gloo, NCCL) meet through it, so a ring runs one
  /// TCP store. Null when the ring has one rank.
  std::function<Status(const std::string& key, const std::string& value)> store_set;
  std::function<Result<std::string>(const std::string& key, std::chrono::milliseconds timeout)>
      store_get;
  /// What the control plane knows of ranks that are gone ("rank 1 (spark-b): heartbeat
  /// silent 6 s"), for the message of a collective that timed out; "" when nothing. May be
  /// null.
  std::function<std::string()> missing_ranks;
  /// Reports loading progress ("loading weights 40%"): shown as the not-ready reason.
  std::function<void(const std::string&)> progress;
};

class Backend {
 public:
  virtual ~Backend() = default;
  /// "native" or "exec".
  virtual const char* name() const = 0;
  /// Loads and starts serving; runs on the lifecycle thread and may block until loaded.
  /// Returns an error (with the reason) when it cannot start.
  virtual Status start(BackendContext& ctx) = 0;
  /// Current status; cheap, thread-safe.
  virtual BackendStatus status() = 0;
  /// Stops: graceful within `grace`, then forced. Idempotent.
  virtual void stop(std::chrono::milliseconds grace) = 0;
  /// Rank 0: one real completion of `prompt` (greedy, a few tokens) for the readiness probe;
  /// the generated text. Errc::unsupported when this engine cannot be probed (READY then
  /// rests on its own health, and /health says the probe was skipped).
  virtual Result<std::string> probe(const std::string& /*prompt*/,
                                    std::chrono::milliseconds /*timeout*/) {
    return make_error(Errc::unsupported, std::string(name()) + " engine has no probe");
  }
  /// The daemon found the ring broken (a rank dead or fatal): collectives in flight should
  /// fail at once with `why` instead of waiting out their deadline. Thread-safe.
  virtual void on_ring_problem(const std::string& /*why*/) {}
  /// Rank 0: adds the engine's API routes (/v1/...) before the listener starts.
  virtual void add_routes(HttpServer& /*server*/) {}
};

/// The backend ENGINE names, for this rank.
std::unique_ptr<Backend> make_backend(const RingConfig& cfg, int rank);
/// The native backend (daemon/backend_native.cc).
std::unique_ptr<Backend> make_native_backend(const RingConfig& cfg, int rank);
/// The exec backend (daemon/backend_exec.cc).
std::unique_ptr<Backend> make_exec_backend(const RingConfig& cfg, int rank);

}  // namespace spark::daemon
