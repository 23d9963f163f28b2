#include "cli/ring_state.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/strings.h"

namespace spark::cli {

using nlohmann::json;

std::string head_state_dir(const RingConfig& cfg) {
  if (!cfg.get("STATE_DIR").empty()) return cfg.get("STATE_DIR");
  std::string name = cfg.get("RING_NAME").empty() ? "spark" : cfg.get("RING_NAME");
  // A system install (the package makes /var/lib/sparkctl) keeps every ring's state there,
  // so root's timer and the user who started the ring see the same ring.
  std::error_code ec;
  if (std::filesystem::is_directory(kSystemStateRoot, ec))
    return fmt::format("{}/{}", kSystemStateRoot, name);
  const char* home = std::getenv("HOME");
  return fmt::format("{}/.local/state/sparkctl/{}", home && *home ? home : "/tmp", name);
}

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

std::string self_command() {
  auto cmd = read_file("/proc/self/cmdline");
  if (!cmd) return "?";
  std::string s = *cmd;
  while (!s.empty() && s.back() == '\0') s.pop_back();
  for (auto& c : s)
    if (c == '\0') c = ' ';
  return s;
}

Status ensure_dir(const std::string& dir) {
  const std::error_code ec = make_dirs(dir);
  if (ec)
    return make_error(Errc::io,
                      fmt::format("cannot create the state directory {}: {} (set STATE_DIR to a "
                                  "writable directory; under {} the group sparkctl may create it)",
                                  dir, ec.message(), kSystemStateRoot));
  return Status::Ok();
}

}  // namespace

RingLock& RingLock::operator=(RingLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

RingLock::~RingLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor releases the flock
}

Result<RingLock> RingLock::acquire(const std::string& state_dir, const std::string& what,
                                   int64_t wait_ms) {
  SPARK_TRY(ensure_dir(state_dir));
  std::string path = state_dir + "/ring.lock";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0640);
  if (fd < 0)
    return make_error(Errc::io,
                      fmt::format("cannot open the ring lock {}: {}", path, std::strerror(errno)));
  adopt_dir_owner(path);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    if (errno != EWOULDBLOCK && errno != EINTR) {
      int e = errno;
      ::close(fd);
      return make_error(Errc::io, fmt::format("flock {}: {}", path, std::strerror(e)));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string holder = std::string(trim(read_file(path).value_or("")));
      ::close(fd);
      return make_error(
          Errc::busy,
          fmt::format("the ring lock {} is held by {}{}: another start, stop, restart or watch "
                      "heal is running; wait for it (--lock-wait) or check that process",
                      path, holder.empty() ? "another process" : holder,
                      wait_ms > 0 ? fmt::format(" (waited {:.1f} s)", wait_ms / 1000.0) : ""));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::string holder = fmt::format("pid {} ({}: {})", ::getpid(), what, self_command());
  if (::ftruncate(fd, 0) == 0) {
    ssize_t n = ::pwrite(fd, holder.data(), holder.size(), 0);
    (void)n;
  }
  RingLock l;
  l.fd_ = fd;
  return l;
}

std::string marker_path(const std::string& state_dir, Marker m) {
  return state_dir + (m == Marker::disabled ? "/DISABLED" : "/GAVE_UP");
}

std::optional<json> read_marker(const std::string& state_dir, Marker m) {
  auto text = read_file(marker_path(state_dir, m));
  if (!text) return std::nullopt;
  json j = json::parse(*text, nullptr, false);
  if (!j.is_object()) j = json{{"reason", std::string(trim(*text))}};
  return j;
}

Status set_marker(const std::string& state_dir, Marker m, const std::string& reason) {
  SPARK_TRY(ensure_dir(state_dir));
  json j = {{"at_ms", wall_ms()}, {"by", fmt::format("pid {}", ::getpid())}, {"reason", reason}};
  std::string why;
  const std::string path = marker_path(state_dir, m);
  if (!write_file_atomic(path, j.dump() + "\n", &why, 0640))
    return make_error(Errc::io, fmt::format("cannot write {}: {}", path, why));
  adopt_dir_owner(path);
  return Status::Ok();
}

void clear_marker(const std::string& state_dir, Marker m) {
  ::unlink(marker_path(state_dir, m).c_str());
}

RingRecord read_ring_record(const std::string& state_dir) {
  RingRecord r;
  auto text = read_file(state_dir + "/ring.json");
  if (!text) return r;
  json j = json::parse(*text, nullptr, false);
  if (!j.is_object()) return r;
  r.started = j.value("started", false);
  r.launched_ms = j.value("launched_ms", int64_t{0});
  r.ready_ms = j.value("ready_ms", int64_t{0});
  r.endpoint = j.value("endpoint", "");
  r.model = j.value("model", "");
  r.by = j.value("by", "");
  if (j.contains("pids") && j["pids"].is_array())
    for (const auto& p : j["pids"])
      if (p.is_number_integer()) r.pids.push_back(p.get<int>());
  return r;
}

Status write_ring_record(const std::string& state_dir, const RingRecord& r) {
  SPARK_TRY(ensure_dir(state_dir));
  json j = {{"started", r.started},
            {"launched_ms", r.launched_ms},
            {"ready_ms", r.ready_ms},
            {"endpoint", r.endpoint},
            {"model", r.model},
            {"pids", r.pids},
            {"by", r.by}};
  std::string why;
  const std::string path = state_dir + "/ring.json";
  if (!write_file_atomic(path, j.dump(2) + "\n", &why, 0640))
    return make_error(Errc::io, fmt::format("cannot write {}/ring.json: {}", state_dir, why));
  adopt_dir_owner(path);
  return Status::Ok();
}

WatchRecord read_watch_record(const std::string& state_dir) {
  WatchRecord w;
  auto text = read_file(state_dir + "/watch.json");
  if (!text) return w;
  json j = json::parse(*text, nullptr, false);
  if (!j.is_object()) return w;
  w.failures = j.value("failures", 0);
  w.last_check_ms = j.value("last_check_ms", int64_t{0});
  w.last_verdict = j.value("last_verdict", "");
  w.last_reason = j.value("last_reason", "");
  if (j.contains("restarts_ms") && j["restarts_ms"].is_array())
    for (const auto& t : j["restarts_ms"])
      if (t.is_number_integer()) w.restarts_ms.push_back(t.get<int64_t>());
  return w;
}

Status write_watch_record(const std::string& state_dir, const WatchRecord& w) {
  SPARK_TRY(ensure_dir(state_dir));
  json j = {{"failures", w.failures},
            {"restarts_ms", w.restarts_ms},
            {"last_check_ms", w.last_check_ms},
            {"last_verdict", w.last_verdict},
            {"last_reason", w.last_reason}};
  std::string why;
  const std::string path = state_dir + "/watch.json";
  if (!write_file_atomic(path, j.dump(2) + "\n", &why, 0640))
    return make_error(Errc::io, fmt::format("cannot write {}/watch.json: {}", state_dir, why));
  adopt_dir_owner(path);
  return Status::Ok();
}

}  // namespace spark::cli
