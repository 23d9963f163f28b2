#pragma once
// The daemon's view of itself: liveness vs readiness, with the reason when not ready.
// `live` means the process answers; `ready` means every rank joined, the engine loaded and
// serves; `fatal` means it will not get better without a restart; `stalled` means an engine
// call is older than its deadline.
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace spark::daemon {

/// Lifecycle states reported by /health and `sparkctl status`.
enum class State { starting, loading, ready, fatal, stalled, stopping };

/// Stable lower-case name of a state.
const char* state_name(State s);
/// Parses a state name; false when unknown.
bool parse_state(const std::string& name, State* out);

/// Thread-safe health record shared by the engine, rendezvous and the HTTP threads.
class Health {
 public:
  Health();
  /// Sets the state and its reason. A fatal state is sticky: later calls cannot leave it
  /// except to `stopping` (a dead ring does not heal itself; the watchdog restarts it).
  void set(State s, std::string reason);
  State state() const;
  std::string reason() const;
  bool ready() const { return state() == State::ready; }
  /// Seconds since the daemon started.
  double uptime_s() const;
  /// Minimal JSON (state, reason, flags, rank, uptime); the daemon adds the rest.
  nlohmann::json to_json(int rank, int world_size) const;

 private:
  mutable std::mutex mu_;
  State state_ = State::starting;
  std::string reason_ = "starting";
  std::chrono::steady_clock::time_point started_;
};

/// One rank as rank 0 sees it (from rendezvous and heartbeats).
struct RankHealth {
  int rank = 0;
  std::string node;
  std::string host;         // hostname the rank reported
  std::string state;        // state_name() of that rank, or "down" / "unknown"
  std::string reason;       // why not ready
  bool joined = false;      // registered at rendezvous
  bool alive = false;       // heartbeats arriving
  double last_seen_s = -1;  // seconds since the last heartbeat; -1 never
  int pid = 0;
  std::string device;  // what computes on that rank (empty: not reported yet)
  /// MemAvailable of the rank's node in bytes, as its last heartbeat said (0: not reported).
  uint64_t mem_available = 0;
};

/// Everything GET /health reports.
struct HealthSnapshot {
  State state = State::starting;
  std::string reason;
  int rank = 0;
  int world_size = 1;
  double uptime_s = 0;
  std::vector<RankHealth> ranks;
  int slots_total = 0;
  int slots_busy = 0;
  int requests_in_flight = 0;
  std::string engine;
  std::string model;
  std::string version;
  int pid = 0;
  nlohmann::json probe;         // rank 0's readiness probe (null elsewhere)
  nlohmann::json fabric;        // this rank's fabric self-test (null when it did not run)
  nlohmann::json fabric_ranks;  // rank 0: every rank's fabric self-test, in rank order
  std::string device;           // what computes on this rank
  std::string device_note;      // why DEVICE=auto chose the CPU
  nlohmann::json model_info;    // what the engine serves (architecture, experts, split, KV cache)
};

/// The /health JSON body (schema in man/sparkd.8):
/// {ok, live, ready, state, reason?, fatal, stalled, rank, world_size, ranks_alive,
///  ranks:[{rank,node,host,state,reason?,joined,alive,last_seen_s,pid,device?}],
///  slots:{total,busy}, requests_in_flight, uptime_s, engine, model, version, pid, device?,
///  device_note?, model_info?}
nlohmann::json health_json(const HealthSnapshot& s);

/// True when a strict check passes: ready, not fatal, not stalled, every rank alive.
bool strict_ok(const HealthSnapshot& s);

}  // namespace spark::daemon
