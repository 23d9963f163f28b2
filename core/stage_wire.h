#pragma once
// The stage-weights wire protocol: plain TCP between fabric addresses, unencrypted (a
// point-to-point cable), authenticated by a one-time token that the sender hands to the
// receiver over SSH. Every frame is a 24-byte header plus a payload:
//   magic "SPKW" | type u8 | status u8 | 2 bytes 0 | a u32 | b u32 | length u64
// Integers are little-endian. Stream 0 is the control stream (MANIFEST → PLAN, FINISH →
// REPORT); streams 1..N carry CHUNK frames, each answered by an ACK.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "core/error.h"

namespace spark::stage {

enum class Frame : uint8_t {
  hello = 1,     // a = stream id; payload = token
  manifest = 2,  // payload = JSON {manifest, options}
  plan = 3,      // payload = JSON (what the receiver needs, free space)
  chunk = 4,     // a = file index, b = chunk index; payload = bytes
  ack = 5,       // a, b as in chunk; status = AckStatus
  done = 6,      // no more chunks on this stream
  finish = 7,    // control: finalize, verify, report; payload = JSON options
  report = 8,    // payload = JSON receiver report
  error = 9,     // payload = message; the peer stops
  abort = 10,    // control: the sender gives up (e.g. not enough space); receiver exits
  forward = 11,  // control: chain mode, forward to the next receiver (JSON); acked in kind
};

enum class AckStatus : uint8_t { ok = 0, bad_hash = 1 };

struct Header {
  Frame type = Frame::error;
  uint8_t status = 0;
  uint32_t a = 0;
  uint32_t b = 0;
  uint64_t length = 0;
};

inline constexpr size_t kHeaderSize = 24;
inline constexpr uint64_t kMaxControlPayload = 1ull << 30;

/// A connected TCP socket with per-operation deadlines (SO_RCVTIMEO/SO_SNDTIMEO) so that no
/// read or write waits forever; `peer` names the other side in every message.
class Conn {
 public:
  Conn() = default;
  Conn(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~Conn();
  Conn(Conn&& o) noexcept : fd_(o.fd_), peer_(std::move(o.peer_)) { o.fd_ = -1; }
  Conn& operator=(Conn&& o) noexcept;
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  bool valid() const { return fd_ >= 0; }
  void close();
  /// Sets the deadline of each following read/write.
  void set_timeout(std::chrono::milliseconds t);

  Status send_all(const void* data, size_t n);
  Status recv_all(void* data, size_t n);
  Status send_frame(const Header& h, const void* payload = nullptr);
  /// Sends a header whose payload the caller sends next with send_all.
  Status send_header(const Header& h);
  Result<Header> recv_header();
  /// Receives a control frame's whole payload (length bounded by kMaxControlPayload).
  Result<std::string> recv_payload(const Header& h);

 private:
  int fd_ = -1;
  std::string peer_;
  std::chrono::milliseconds timeout_{60000};
};

/// Connects to ip:port within `timeout`; `who` names the peer in errors (node name).
Result<Conn> connect_to(const std::string& ip, int port, std::chrono::milliseconds timeout,
                        const std::string& who);

/// A listening socket on ip (port 0: any free port).
struct Listener {
  int fd = -1;
  int port = 0;
  std::string ip;
  ~Listener();
};
Result<std::unique_ptr<Listener>> listen_on(const std::string& ip, int port);

/// A fresh one-time token (64 hex digits from /dev/urandom).
Result<std::string> make_token();
/// Constant-time comparison of two tokens.
bool token_equal(const std::string& a, const std::string& b);

}  // namespace spark::stage
