#pragma once
// The receiving half of stage-weights: listens on the target's fabric address(es), accepts
// only connections that present the one-time token, plans what it still needs (skipping
// files that already match, resuming partial files from their journal of verified chunks),
// writes each chunk of FILE into FILE.sparkctl-partial while hashing it, journals a chunk
// only after it matched the manifest and was fdatasync'ed, and renames a file to its final
// name only when its whole-file XXH3-128 matches. Serves exactly one sender session.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/stage_wire.h"

namespace spark::stage {

/// How a receiver runs.
struct ReceiverOptions {
  std::string dir;                                 // target model directory (created if missing)
  std::vector<std::string> bind_ips;               // fabric address(es) to listen on
  int port = 0;                                    // 0: any free port
  std::string token;                               // the one-time token
  std::chrono::milliseconds idle_timeout{120000};  // no traffic this long: give up
  std::string node = "receiver";                   // for messages
  // FAULT INJECTION ONLY (tests): take journaled chunks as verified at plan time without
  // hashing them again, as resume did before it checked them, so that a test can show
  // that the hash before the final rename still keeps a changed chunk from a final name.
  bool fault_trust_journal = false;
};

/// One receiving session.
class Receiver {
 public:
  /// Binds the listeners (so their ports are known before run()).
  static Result<std::unique_ptr<Receiver>> create(ReceiverOptions opts);
  virtual ~Receiver() = default;
  /// Port per bind address, in the order of bind_ips.
  virtual std::vector<int> ports() const = 0;
  /// Serves one sender until it finished (REPORT sent), aborted, vanished or went idle.
  /// Returns the report JSON text it sent (or would have sent) on success.
  virtual Result<std::string> run() = 0;
};

}  // namespace spark::stage
