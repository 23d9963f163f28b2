#pragma once
// The daemon's view of itself: liveness vs readiness, with the reason when not ready.
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

namespace spark::daemon {

/// Lifecycle states reported by /health and `sparkctl status`.
enum class State { starting, loading, ready, fatal, stalled, stopping };

/// Stable lower-case name of a state.
const char* state_name(State s);

/// Thread-safe health record shared by the engine and the HTTP threads.
class Health {
 public:
  Health();
  void set(State s, std::string reason);
  State state() const;
  std::string reason() const;
  bool ready() const { return state() == State::ready; }
  /// Seconds since the daemon started.
  double uptime_s() const;
  /// JSON body of GET /health.
  nlohmann::json to_json(int rank, int world_size) const;

 private:
  mutable std::mutex mu_;
  State state_ = State::starting;
  std::string reason_ = "starting";
  std::chrono::steady_clock::time_point started_;
};

}  // namespace spark::daemon
