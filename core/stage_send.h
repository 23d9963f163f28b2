#pragma once
// The sending half of stage-weights: asks every target's receiver what it still needs,
// checks free space (including the DISK_MAX_USE mark) before sending anything, then reads
// the source once (one reader reads ahead chunk by chunk into the page cache; the streams
// sendfile from it) and feeds every target in parallel over several TCP streams each; a
// chunk the receiver rejects is sent again. Ends with each receiver's final verification
// report.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/manifest.h"

namespace spark::stage {

/// One receiver to feed.
struct TargetSpec {
  std::string node;
  std::vector<std::pair<std::string, int>> addrs;  // ip, port (one per fabric address)
  std::string token;
};

/// Live progress, per target and in total.
struct Progress {
  struct Target {
    std::string node;
    uint64_t done = 0;   // bytes acknowledged
    uint64_t total = 0;  // bytes this target needs
  };
  std::vector<Target> targets;
  uint64_t done = 0, total = 0;
  double seconds = 0;
  double rate() const { return seconds > 0 ? static_cast<double>(done) / seconds : 0; }
};

/// How to send.
struct SendOptions {
  int streams = 4;          // TCP streams per target
  bool deep = false;        // receivers rehash existing files instead of trusting size+mtime
  bool keep_cache = false;  // leave page cache of written/read files alone
  int max_use_pct = 85;     // DISK_MAX_USE: highest target disk use after staging
  std::chrono::milliseconds timeout{60000};  // per network operation
  std::chrono::milliseconds plan_timeout{30 * 60000};
  std::function<void(const Progress&)> progress;  // called about twice a second
  // Fault injection (tests only): flip one byte of the Nth chunk sent to each target (first
  // attempt), and sleep this long after each chunk to make kills land mid-transfer.
  int64_t fault_corrupt_chunk = -1;
  int fault_delay_ms = 0;
  // Chain mode: feed only the first target; each target forwards what the next ones need
  // as it arrives (one copy per link instead of N copies on the source's link).
  bool chain = false;
};

/// Outcome for one target.
struct TargetResult {
  std::string node;
  bool ok = false;
  std::string error;
  Errc code = Errc::ok;
  uint64_t need_bytes = 0, skip_bytes = 0, resume_bytes = 0;
  uint64_t resume_mismatch_chunks = 0;  // journaled chunks that no longer matched: resent
  uint64_t skip_files = 0;
  uint64_t fs_free = 0, fs_total = 0, fs_used = 0;
  uint64_t bytes_sent = 0;  // payload bytes, resends included
  uint64_t chunks_sent = 0;
  uint64_t chunks_resent = 0;
  double seconds = 0;
  std::string receiver_report;  // JSON from the receiver's final pass
};

/// Outcome of one staging run.
struct SendReport {
  bool ok = false;
  std::string digest;
  uint64_t total_bytes = 0;
  uint64_t bytes_read = 0;  // from the source disk (each needed chunk once)
  /// The page cache of the source after the send (0 and 0 with keep_cache): the bytes of the
  /// files read that the sender asked the kernel to drop, and those still resident after its
  /// final drop. Pages the network stack still holds (sendfile lends them to the socket, and
  /// the kernel may free a sent buffer later, on the CPU that made it) cannot be dropped
  /// and stay in cache_left_bytes; they are the kernel's to free.
  uint64_t cache_dropped_bytes = 0;
  uint64_t cache_left_bytes = 0;
  double seconds = 0;
  std::vector<TargetResult> targets;
};

/// Chain mode, inside a receiver: feeds the next receiver of the chain with chunks the
/// caller received and verified. push() blocks while the downstream is behind (that
/// backpressure paces the chain); finish() waits for every ack.
class Forwarder {
 public:
  /// need_ranges: per file, [[first, end), ...] chunk ranges the downstream must receive.
  static Result<std::unique_ptr<Forwarder>> start(const TargetSpec& next, const Manifest& m,
                                                  const std::string& need_ranges_json, int streams,
                                                  std::chrono::milliseconds timeout);
  virtual ~Forwarder() = default;
  virtual bool needs(uint32_t file, uint32_t chunk) const = 0;
  /// Queues a verified chunk (len bytes at data, which must come from std::aligned_alloc and
  /// is freed by the forwarder).
  virtual void push(uint32_t file, uint32_t chunk, char* data, uint64_t len) = 0;
  virtual Status finish() = 0;
  virtual uint64_t bytes_sent() const = 0;
  virtual const std::string& node() const = 0;
};

/// Free-space verdict for a target (empty when it fits). Pure: used by the sender and tests.
std::string space_problem(const std::string& node, uint64_t new_bytes, uint64_t fs_free,
                          uint64_t fs_total, uint64_t fs_used, int max_use_pct);

/// Stages `dir` (described by `m`) to every target. Fails before sending any data when a
/// target cannot take it (space, permissions, hostile state); otherwise returns a report in
/// which each target says ok or why not.
Result<SendReport> send_model(const std::string& dir, const Manifest& m,
                              const std::vector<TargetSpec>& targets, const SendOptions& opts);

}  // namespace spark::stage
