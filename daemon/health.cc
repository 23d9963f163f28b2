#include "daemon/health.h"

namespace spark::daemon {

const char* state_name(State s) {
  switch (s) {
    case State::starting:
      return "starting";
    case State::loading:
      return "loading";
    case State::ready:
      return "ready";
    case State::fatal:
      return "fatal";
    case State::stalled:
      return "stalled";
    case State::stopping:
      return "stopping";
  }
  return "unknown";
}

bool parse_state(const std::string& name, State* out) {
  for (State s : {State::starting, State::loading, State::ready, State::fatal, State::stalled,
                  State::stopping}) {
    if (name == state_name(s)) {
      *out = s;
      return true;
    }
  }
  return false;
}

Health::Health() : started_(std::chrono::steady_clock::now()) {}

void Health::set(State s, std::string reason) {
  std::lock_guard lk(mu_);
  if (state_ == State::fatal && s != State::stopping && s != State::fatal) return;
  if (state_ == State::stopping) return;
  state_ = s;
  reason_ = std::move(reason);
}

State Health::state() const {
  std::lock_guard lk(mu_);
  return state_;
}

std::string Health::reason() const {
  std::lock_guard lk(mu_);
  return reason_;
}

double Health::uptime_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

nlohmann::json Health::to_json(int rank, int world_size) const {
  HealthSnapshot s;
  {
    std::lock_guard lk(mu_);
    s.state = state_;
    s.reason = reason_;
  }
  s.rank = rank;
  s.world_size = world_size;
  s.uptime_s = uptime_s();
  return health_json(s);
}

bool strict_ok(const HealthSnapshot& s) {
  if (s.state != State::ready) return false;
  for (const auto& r : s.ranks)
    if (!r.alive) return false;
  return true;
}

nlohmann::json health_json(const HealthSnapshot& s) {
  nlohmann::json j;
  bool fatal = s.state == State::fatal;
  bool stalled = s.state == State::stalled;
  int alive = 0;
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : s.ranks) {
    if (r.alive) ++alive;
    nlohmann::json rj = {{"rank", r.rank},
                         {"node", r.node},
                         {"host", r.host},
                         {"state", r.state},
                         {"joined", r.joined},
                         {"alive", r.alive},
                         {"last_seen_s", r.last_seen_s},
                         {"pid", r.pid}};
    if (!r.reason.empty()) rj["reason"] = r.reason;
    if (!r.device.empty()) rj["device"] = r.device;
    if (r.mem_available) rj["mem_available_bytes"] = r.mem_available;
    ranks.push_back(rj);
  }
  j["ok"] = strict_ok(s);
  j["live"] = s.state != State::stopping;
  j["ready"] = s.state == State::ready;
  j["state"] = state_name(s.state);
  if (s.state != State::ready) j["reason"] = s.reason;
  j["fatal"] = fatal;
  j["stalled"] = stalled;
  j["rank"] = s.rank;
  j["world_size"] = s.world_size;
  j["ranks_alive"] = s.ranks.empty() ? 1 : alive;
  j["ranks"] = ranks;
  j["slots"] = {{"total", s.slots_total}, {"busy", s.slots_busy}};
  j["requests_in_flight"] = s.requests_in_flight;
  j["uptime_s"] = s.uptime_s;
  j["engine"] = s.engine;
  j["model"] = s.model;
  j["version"] = s.version;
  j["pid"] = s.pid;
  if (!s.probe.is_null()) j["probe"] = s.probe;
  if (!s.fabric.is_null()) j["fabric"] = s.fabric;
  if (!s.fabric_ranks.is_null()) j["fabric_ranks"] = s.fabric_ranks;
  if (!s.device.empty()) j["device"] = s.device;
  if (!s.device_note.empty()) j["device_note"] = s.device_note;
  if (!s.model_info.is_null()) j["model_info"] = s.model_info;
  return j;
}

}  // namespace spark::daemon
