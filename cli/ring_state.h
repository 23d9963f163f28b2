#pragma once
// The ring's state on the head (STATE_DIR): the ring lock that keeps start, stop, restart and
// a watch heal from overlapping, the DISABLED and GAVE_UP markers, the record of the last
// launch (ring.json) and the watch's counters (watch.json). Every file is written atomically;
// a missing or unreadable file reads as "no record".
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// STATE_DIR on the head: the key's value, else ~/.local/state/sparkctl/RING_NAME.
/// The system-wide state root: when it exists (a system install), the default STATE_DIR is
/// kSystemStateRoot/RING_NAME on every node, else ~/.local/state/sparkctl/RING_NAME.
inline constexpr const char* kSystemStateRoot = "/var/lib/sparkctl";
std::string head_state_dir(const RingConfig& cfg);

/// Wall-clock now in milliseconds since the epoch (state files record wall time).
int64_t wall_ms();

/// An exclusive flock on STATE_DIR/ring.lock; released when the object goes away. The file
/// holds the holder's pid and command so a waiter can name it.
class RingLock {
 public:
  /// Waits up to `wait_ms` for the lock (0: one try). `what` names this holder ("start").
  /// Errc::busy naming the holder's pid and command when it is still held.
  static Result<RingLock> acquire(const std::string& state_dir, const std::string& what,
                                  int64_t wait_ms);
  RingLock() = default;
  RingLock(RingLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  RingLock& operator=(RingLock&& o) noexcept;
  RingLock(const RingLock&) = delete;
  RingLock& operator=(const RingLock&) = delete;
  ~RingLock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// The markers (files whose presence is the state).
enum class Marker { disabled, gave_up };
/// Path of a marker file.
std::string marker_path(const std::string& state_dir, Marker m);
/// The marker's JSON content when present.
std::optional<nlohmann::json> read_marker(const std::string& state_dir, Marker m);
/// Writes a marker ({"at_ms","by","reason"}). Errc::io naming the file.
Status set_marker(const std::string& state_dir, Marker m, const std::string& reason);
/// Removes a marker (absent is fine).
void clear_marker(const std::string& state_dir, Marker m);

/// What the last start recorded (ring.json).
struct RingRecord {
  bool started = false;     // a start ran at least once (watch does nothing before)
  int64_t launched_ms = 0;  // when sparkd was launched (the start-up grace counts from here)
  int64_t ready_ms = 0;     // when READY was seen (0: not yet)
  std::string endpoint;     // http://host:port
  std::string model;
  std::vector<int> pids;  // per rank, as launched
  std::string by;         // "start", "restart", "watch"
};
RingRecord read_ring_record(const std::string& state_dir);
Status write_ring_record(const std::string& state_dir, const RingRecord& r);

/// What watch keeps between runs (watch.json).
struct WatchRecord {
  int failures = 0;                  // consecutive failed checks
  std::vector<int64_t> restarts_ms;  // restarts by watch inside the window
  int64_t last_check_ms = 0;
  std::string last_verdict;  // healthy, grace, unhealthy, restarted, backoff, gave_up, ...
  std::string last_reason;
};
WatchRecord read_watch_record(const std::string& state_dir);
Status write_watch_record(const std::string& state_dir, const WatchRecord& w);

}  // namespace spark::cli
