#pragma once
// The ring's lifecycle as library calls returning reports: start (lock, preflight, evict,
// memory gate, launch, READY or tear down), stop (DISABLED marker, SIGTERM/grace/SIGKILL,
// nothing left), status, and one watch pass (strict health, failure counter, restart with
// cap and backoff, GAVE_UP, alert command). cmd_ring.cc prints them.
#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/ring_nodes.h"
#include "cli/ring_state.h"
#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// One step of start, for the report.
struct StartStep {
  /// lock, ssh, preflight, evict, memory, launch, then rank 0's phases while it comes up
  /// (rendezvous, load, fabric, probe), ready; teardown after a failure.
  std::string name;
  bool ok = true;
  std::string detail;
  double seconds = 0;
};

/// Where a coming-up rank is, from the reason its /health gives: rendezvous, load, fabric,
/// probe, ready, or "" when the reason names none of them.
std::string start_phase(const std::string& state, const std::string& reason);

/// Live progress of start for a terminal or a log: each step as it ends, and while the ring
/// comes up, every rank's phase (called about every 200 ms; the printer decides how often
/// to show it).
struct StartProgress {
  std::function<void(const StartStep&)> step;
  std::function<void(const std::string& ranks)> waiting;
};

/// Options of start (and of the start half of restart and of a watch heal).
struct StartOptions {
  bool skip_preflight = false;
  bool wait_ready = true;  // false: return once launched (watch's grace covers loading)
  int64_t lock_wait_ms = 30000;
  std::string by = "start";  // start, restart, watch
  StartProgress progress;    // empty: quiet
};

/// What start did.
struct StartReport {
  bool ready = false;
  int attempts = 0;
  std::string endpoint;
  std::string model;
  int world_size = 0;
  std::vector<StartStep> steps;
  std::vector<LaunchResult> ranks;
  std::vector<std::string> warnings;
  std::optional<Error> error;  // why it failed (after teardown)
  bool torn_down = false;      // a launched attempt was stopped again (else nothing ran)
  double seconds = 0;
  StartProgress progress;  // not reported: where steps are shown as they end
};

/// What stop did.
struct StopReport {
  std::vector<StopResult> ranks;
  bool clean = true;  // nothing left on any node
  bool disabled = false;
  std::optional<Error> error;
  double seconds = 0;
};

/// One rank in status.
struct RankStatus {
  int rank = 0;
  std::string node;
  std::string state;  // starting, loading, ready, fatal, stalled, stopping, down
  std::string reason;
  int pid = 0;
  int64_t uptime_s = -1;
  bool alive = false;       // the process runs on its node
  double last_seen_s = -1;  // rank 0's last heartbeat from it
  std::string device;       // what computes on it (native engine), from rank 0's /health
};

/// One node in status.
struct NodeStatus {
  std::string node;
  std::string error;  // unreachable
  int64_t mem_free = -1, mem_available = -1, mem_total = -1;
  std::vector<std::pair<int64_t, int64_t>> gpu_mem_mib;
};

/// Everything status shows.
struct RingStatus {
  std::string ring, model, endpoint, engine;
  bool ready = false;  // strict: rank 0 ready, not fatal/stalled, every rank alive
  std::string state;   // rank 0's state, or down
  std::string reason;
  bool answered = false;  // rank 0's /health answered
  std::optional<nlohmann::json> health;
  std::optional<nlohmann::json> disabled, gave_up;
  int slots_total = 0, slots_busy = 0, requests_in_flight = 0;
  int restarts = 0;  // by watch, in the window
  int watch_failures = 0;
  std::string last_watch_verdict, last_watch_reason;
  int64_t last_watch_ms = 0;
  RingRecord record;
  std::vector<RankStatus> ranks;
  std::vector<NodeStatus> nodes;
};

/// What one watch pass decided.
struct WatchReport {
  std::string verdict;  // disabled, busy, not_started, gave_up, healthy, grace, unhealthy,
                        // backoff, restarted, restart_failed
  std::string reason;
  int failures = 0;
  int failures_needed = 0;
  int restarts_in_window = 0;
  std::optional<StartReport> restart;
  std::string incident_dir;         // where the log tails were saved before a restart
  std::vector<std::string> alerts;  // events the alert command ran for
};

/// The binaries on the nodes: SPARKD_BIN / SPARKCTL_BIN or beside this sparkctl.
RingLayout ring_layout(const RingConfig& cfg, const std::string& argv0);

StartReport start_ring(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt);
/// `disable`: write DISABLED (stop); false for the stop half of restart and watch.
StopReport stop_ring(const RingConfig& cfg, const RingLayout& lay, bool disable,
                     int64_t lock_wait_ms);
/// stop (no marker) then start, under one lock. `on_stopped`, when set, gets the stop
/// half's report as soon as it is done, before the start half begins (so that a caller
/// showing the start's steps as they happen shows the stop first).
StartReport restart_ring(const RingConfig& cfg, const RingLayout& lay, const StartOptions& opt,
                         StopReport* stopped,
                         const std::function<void(const StopReport&)>& on_stopped = {});
RingStatus ring_status(const RingConfig& cfg, const RingLayout& lay);
WatchReport watch_once(const RingConfig& cfg, const RingLayout& lay);

/// Strict health of a /health body: empty when healthy, else why not.
std::string strict_problem(const nlohmann::json& health);

nlohmann::json to_json(const StartReport& r);
nlohmann::json to_json(const StopReport& r);
nlohmann::json to_json(const RingStatus& s);
nlohmann::json to_json(const WatchReport& w);

/// The fabric self-test's lines of `sparkctl status` from rank 0's /health: one per rank
/// from `fabric_ranks` (every rank's report), else one from `fabric` (rank 0's alone, an
/// older daemon); "" when the ring ran no self-test.
std::string fabric_status_lines(const nlohmann::json& health);

}  // namespace spark::cli
