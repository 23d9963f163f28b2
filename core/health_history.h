#pragma once
// The health history: a bounded on-disk ring buffer of fixed-size samples that sparkd
// writes every HEALTH_SAMPLE_INTERVAL and sparkctl reads (status --history, bundle), made so
// that a power cut or a frozen host loses at most the sample being written.
//
// File layout: a 256-byte header record (magic, version, record size, capacity), then
// `capacity` slots of 256 bytes; sample number `seq` (1, 2, ...) lives in slot
// (seq - 1) % capacity. Every record carries its sequence number and an XXH3-64 checksum
// of the rest, so a reader takes the valid records, orders them by seq and ignores a torn
// or never-written slot. The header is written once, at creation; a sample is one pwrite
// of one aligned record on a descriptor opened O_DSYNC: the call returns only after the
// record is on stable storage (the same guarantee as write + fdatasync, in one system call
// and without a window where a returned write is only in the page cache). A write torn by
// the power cut spoils only its own slot (checksum), never an older sample, because no
// write ever spans two slots and the header is never rewritten. A restarted writer goes on
// after the highest valid seq. Each sample carries the boot id, so a reboot is visible.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark {

/// One sample. Unknown values are -1 (throttle_reasons: kUnknownThrottle).
struct HealthSample {
  static constexpr uint64_t kUnknownThrottle = ~uint64_t{0};
  uint64_t seq = 0;
  int64_t time_ms = 0;  // CLOCK_REALTIME
  std::string boot_id;  // /proc/sys/kernel/random/boot_id ("" unknown)
  int rank = 0;
  int world_size = 1;
  int64_t mem_available = -1, mem_free = -1, page_cache = -1;  // bytes (/proc/meminfo)
  // Pressure stall information, avg10 in percent (/proc/pressure/*).
  double psi_mem_some = -1, psi_mem_full = -1, psi_cpu_some = -1, psi_io_some = -1,
         psi_io_full = -1;
  int sm_clock_mhz = -1, sm_clock_max_mhz = -1, mem_clock_mhz = -1;  // NVML
  int power_mw = -1, power_limit_mw = -1, temp_c = -1;               // NVML
  uint64_t throttle_reasons = kUnknownThrottle;   // NVML clocks-event reasons (bit mask)
  int64_t gpu_mem_used = -1, gpu_mem_total = -1;  // bytes (NVML; GB10: unified, often N/A)
  double tokens_per_s = -1;  // generated tokens per second since the last sample
  int64_t step_age_ms = -1;  // age of the oldest engine call
  uint32_t ranks_alive = 0;  // bit r: rank r alive (rank 0's view; own bit elsewhere)
  int state = 0;             // daemon State (daemon/health.h order)
  std::string reason;        // why not ready (cut to 80 bytes)
};

/// The size of one record (and of the header).
inline constexpr size_t kHistoryRecordSize = 256;

/// Encodes a sample into one record (with its checksum).
std::string encode_sample(const HealthSample& s);
/// Decodes a record; false when its magic, version or checksum is wrong or it is empty.
bool decode_sample(const void* record, HealthSample* out);

/// Appends samples to a history file (one thread).
class HistoryWriter {
 public:
  HistoryWriter() = default;
  ~HistoryWriter();
  HistoryWriter(const HistoryWriter&) = delete;
  HistoryWriter& operator=(const HistoryWriter&) = delete;
  /// Opens or creates `path` with room for `capacity` samples (its directory is created).
  /// A file of another capacity or format is kept as `path.old` and a new one is started.
  Status open(const std::string& path, uint64_t capacity);
  /// Writes `s` as the next sample (its seq is set); durable when this returns.
  Status append(HealthSample& s);
  uint64_t last_seq() const { return seq_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  uint64_t capacity_ = 0, seq_ = 0;
  std::string path_;
};

/// Every valid sample of a history file, oldest first. Errc::not_found when there is no
/// file; Errc::integrity when it is not a history file.
Result<std::vector<HealthSample>> read_history(const std::string& path);

/// The history file of rank `rank` under a node's state directory.
std::string history_path(const std::string& state_dir, int rank);

nlohmann::json to_json(const HealthSample& s);
HealthSample sample_from_json(const nlohmann::json& j);

}  // namespace spark
