#include "daemon/health.h"

namespace spark::daemon {

const char* state_name(State s) {
  switch (s) {
    case State::starting: return "starting";
    case State::loading: return "loading";
    case State::ready: return "ready";
    case State::fatal: return "fatal";
    case State::stalled: return "stalled";
    case State::stopping: return "stopping";
  }
  return "unknown";
}

Health::Health() : started_(std::chrono::steady_clock::now()) {}

void Health::set(State s, std::string reason) {
  std::lock_guard lk(mu_);
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
  std::lock_guard lk(mu_);
  nlohmann::json j;
  bool fatal = state_ == State::fatal;
  j["ok"] = !fatal && state_ != State::stalled;
  j["live"] = true;
  j["ready"] = state_ == State::ready;
  j["state"] = state_name(state_);
  if (state_ != State::ready) j["reason"] = reason_;
  j["fatal"] = fatal;
  j["stalled"] = state_ == State::stalled;
  j["rank"] = rank;
  j["world_size"] = world_size;
  j["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  return j;
}

}  // namespace spark::daemon
