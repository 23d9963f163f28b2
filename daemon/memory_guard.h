#pragma once
// Memory guard: on unified-memory nodes page cache and a long prefill can starve the whole
// machine. Under the wait floor (MEM_GUARD_WAIT) new requests are held back until memory
// returns (or fail after MEM_GUARD_MAX_WAIT with Errc::resource -> HTTP 429); under the
// cancel floor (MEM_GUARD_CANCEL) the engine's newest request is cancelled with a clear
// error. Both are counted in metrics. MemAvailable is read through a root directory so a
// test drives it with a fixture /proc/meminfo.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "core/config.h"
#include "core/error.h"

namespace spark::daemon {

class Metrics;

struct MemGuardConfig {
  uint64_t wait_floor = 0;    // bytes; 0 = off
  uint64_t cancel_floor = 0;  // bytes; 0 = off
  std::chrono::milliseconds max_wait{30000};
  std::string root = "/";  // /proc/meminfo is read under this root
};
/// From MEM_GUARD_WAIT, MEM_GUARD_CANCEL, MEM_GUARD_MAX_WAIT.
MemGuardConfig mem_guard_config(const RingConfig& cfg);

class MemoryGuard {
 public:
  MemoryGuard(MemGuardConfig cfg, Metrics* metrics);
  /// Reads MemAvailable now; wakes waiters when it is back over the wait floor; under the
  /// cancel floor calls the cancel hook. The daemon's watchdog calls it periodically.
  void sample();
  /// Blocks the calling (engine) thread while MemAvailable is under the wait floor. Errc::resource
  /// naming MemAvailable and the floor after max_wait. Never call it on a reactor thread.
  Status admit();
  /// The engine's hook: cancel the newest running request with `reason`; true if it did.
  void set_cancel_hook(std::function<bool(const std::string& reason)> hook);
  /// Last MemAvailable read (bytes; 0 before the first sample or when unreadable).
  uint64_t available() const { return available_.load(); }
  bool under_wait_floor() const;

 private:
  MemGuardConfig cfg_;
  Metrics* metrics_;
  std::atomic<uint64_t> available_{0};
  std::atomic<bool> sampled_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::function<bool(const std::string&)> cancel_hook_;
};

}  // namespace spark::daemon
