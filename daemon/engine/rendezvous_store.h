#pragma once
// The key-value store that ranks meet through, as the engine sees it. In sparkd it is the
// daemon's own rendezvous on rank 0 (one TCP store per ring: Gloo's mesh addresses and the
// NCCL unique id travel through it); the standalone spark-engine and the tests use the
// engine's TcpStore behind the same interface.
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "core/error.h"

namespace spark::engine {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  /// Publishes `value` (text: callers hex-encode binary blobs) under `key`.
  virtual Status set(const std::string& key, const std::string& value) = 0;
  /// The value of `key`, waiting until some rank sets it; Errc::timeout names the key.
  virtual Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

/// A store made of two functions (the daemon passes its rendezvous client's set and get).
class FunctionStore final : public RendezvousStore {
 public:
  using SetFn = std::function<Status(const std::string&, const std::string&)>;
  using GetFn = std::function<Result<std::string>(const std::string&, std::chrono::milliseconds)>;
  FunctionStore(SetFn set, GetFn get) : set_(std::move(set)), get_(std::move(get)) {}
  Status set(const std::string& key, const std::string& value) override { return set_(key, value); }
  Result<std::string> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return get_(key, timeout);
  }

 private:
  SetFn set_;
  GetFn get_;
};

/// Bytes as lower-case hex, and back (Errc::integrity on a malformed string).
std::string hex_encode(const std::string& bytes);
Result<std::string> hex_decode(const std::string& hex);

}  // namespace spark::engine
