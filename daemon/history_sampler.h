#pragma once
// sparkd's health history sampler: every HEALTH_SAMPLE_INTERVAL, on a thread of its own
// (a sample is a synchronous disk write, and a slow or frozen disk must not hold up the
// reactors), one HealthSample of this node and rank (core/health_history.h): /proc/meminfo,
// PSI, NVML (env/nvml.h) for this rank's GPU, and what the daemon says (state, ranks alive,
// step age, tokens). poke() takes a sample now: the daemon pokes when the state or the set
// of live ranks changes, so the moment a rank is lost is in the history of the survivors.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "core/health_history.h"

namespace spark::daemon {

/// What the daemon adds to a sample.
struct DaemonSample {
  int state = 0;
  std::string reason;
  uint32_t ranks_alive = 0;
  int64_t step_age_ms = -1;
  double generated_tokens = -1;  // counter; the sampler turns it into tokens/s
};

/// Where and how often.
struct SamplerOptions {
  std::string path;  // history file
  uint64_t capacity = 8640;
  std::chrono::milliseconds interval{10000};
  int rank = 0, world_size = 1;
  int gpu = -1;                 // NVML index of this rank's GPU; -1 none
  std::string proc_root = "/";  // /proc is read under it
  std::string nvml_library = "libnvidia-ml.so.1";
};

/// Reads this node's part of a sample (meminfo, PSI, boot id, NVML) into `s`.
void sample_node(const SamplerOptions& opt, HealthSample* s);

class HistorySampler {
 public:
  HistorySampler(SamplerOptions opt, std::function<DaemonSample()> source);
  ~HistorySampler();
  /// Opens the file and starts the thread; an error leaves sparkd running without history.
  Status start();
  /// Takes a sample as soon as possible.
  void poke();
  /// Stops the thread (a last sample is written first).
  void stop();
  uint64_t samples_written() const;

 private:
  void run();
  SamplerOptions opt_;
  std::function<DaemonSample()> source_;
  HistoryWriter writer_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, poked_ = false;
  uint64_t written_ = 0;
  double last_tokens_ = -1;
  std::chrono::steady_clock::time_point last_at_{};
};

}  // namespace spark::daemon
