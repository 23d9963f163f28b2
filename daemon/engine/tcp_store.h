#pragma once
// A small key-value store over TCP for rendezvous: rank 0 serves it, every rank (rank 0
// included) is a client. Gloo's full-mesh connect exchanges its addresses through it; it
// also suits anything else ranks must agree on at start. Every wait has a deadline and
// says which keys (ranks) never appeared.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace spark::engine {

/// The server side, run by rank 0.
class TcpStoreServer {
 public:
  /// Listens on host:port (port 0: any free port; see port()).
  static Result<std::unique_ptr<TcpStoreServer>> start(const std::string& host, int port);
  ~TcpStoreServer();
  int port() const { return port_; }

 private:
  TcpStoreServer() = default;
  void serve();
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::map<std::string, std::string> kv_;
  std::thread thread_;
};

/// A client connection.
class TcpStoreClient {
 public:
  /// Connects to host:port, retrying until `timeout` (the server may start later).
  static Result<std::unique_ptr<TcpStoreClient>> connect(const std::string& host, int port,
                                                         std::chrono::milliseconds timeout);
  ~TcpStoreClient();
  Status set(const std::string& key, const std::string& value);
  /// The value, or nullopt when the key is not set (yet).
  Result<std::optional<std::string>> try_get(const std::string& key);
  /// Waits until every key is set; Errc::timeout names the ones that are not.
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

 private:
  TcpStoreClient() = default;
  Status roundtrip(const std::string& req, std::string* reply_value, bool* found);
  int fd_ = -1;
  std::string where_;
  std::mutex mu_;
};

}  // namespace spark::engine
