#include "core/stage_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "core/strings.h"

namespace spark::stage {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'K', 'W'};

void put32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void tune_socket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // No SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's buffer autotuning and is
  // capped at net.core.{w,r}mem_max (212992 bytes on a stock kernel), far below what one
  // stream of a 200 Gb/s link needs; autotuning grows each buffer up to tcp_{w,r}mem.
}

}  // namespace

Conn::~Conn() {
  close();
}

Conn& Conn::operator=(Conn&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    peer_ = std::move(o.peer_);
    timeout_ = o.timeout_;
    o.fd_ = -1;
  }
  return *this;
}

void Conn::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Conn::set_timeout(std::chrono::milliseconds t) {
  timeout_ = t;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(t.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((t.count() % 1000) * 1000);
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

Status Conn::send_all(const void* data, size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return make_error(Errc::timeout,
                          fmt::format("{} did not take data for {} ms (stalled or gone)", peer_,
                                      timeout_.count()));
      return make_error(Errc::network, fmt::format("sending to {}: {} (the peer closed the "
                                                   "connection: killed, crashed or out of disk?)",
                                                   peer_, std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

Status Conn::recv_all(void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd_, p, n, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return make_error(Errc::timeout,
                          fmt::format("{} sent nothing for {} ms", peer_, timeout_.count()));
      return make_error(Errc::network,
                        fmt::format("receiving from {}: {}", peer_, std::strerror(errno)));
    }
    if (k == 0)
      return make_error(Errc::network,
                        fmt::format("{} closed the connection (killed or gone)", peer_));
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

Status Conn::send_header(const Header& h) {
  unsigned char b[kHeaderSize] = {};
  std::memcpy(b, kMagic, 4);
  b[4] = static_cast<unsigned char>(h.type);
  b[5] = h.status;
  put32(b + 8, h.a);
  put32(b + 12, h.b);
  put64(b + 16, h.length);
  return send_all(b, sizeof b);
}

Status Conn::send_frame(const Header& h, const void* payload) {
  SPARK_TRY(send_header(h));
  if (h.length > 0) SPARK_TRY(send_all(payload, static_cast<size_t>(h.length)));
  return {};
}

Result<Header> Conn::recv_header() {
  unsigned char b[kHeaderSize];
  SPARK_TRY(recv_all(b, sizeof b));
  if (std::memcmp(b, kMagic, 4) != 0)
    return make_error(Errc::network,
                      fmt::format("{} does not speak the stage protocol (bad magic)", peer_));
  Header h;
  h.type = static_cast<Frame>(b[4]);
  h.status = b[5];
  h.a = get32(b + 8);
  h.b = get32(b + 12);
  h.length = get64(b + 16);
  return h;
}

Result<std::string> Conn::recv_payload(const Header& h) {
  if (h.length > kMaxControlPayload)
    return make_error(Errc::network, fmt::format("{} sent a {}-byte control frame (limit {})",
                                                 peer_, h.length, kMaxControlPayload));
  std::string s(static_cast<size_t>(h.length), '\0');
  if (!s.empty()) SPARK_TRY(recv_all(s.data(), s.size()));
  return s;
}

Result<Conn> connect_to(const std::string& ip, int port, std::chrono::milliseconds timeout,
                        const std::string& who) {
  std::string peer = fmt::format("{} ({}:{})", who, ip, port);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1)
    return make_error(Errc::config, fmt::format("{}: '{}' is not an IPv4 address", who, ip));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return make_error(Errc::network, fmt::format("socket: {}", std::strerror(errno)));
  tune_socket(fd);
  Conn c(fd, peer);
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  if (rc != 0 && errno != EINPROGRESS)
    return make_error(Errc::network,
                      fmt::format("cannot connect to {}: {}", peer, std::strerror(errno)));
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    int n = ::poll(&p, 1, static_cast<int>(timeout.count()));
    if (n == 0)
      return make_error(Errc::timeout, fmt::format("{} did not accept a connection within {} ms",
                                                   peer, timeout.count()));
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (n < 0 || err != 0)
      return make_error(Errc::network, fmt::format("cannot connect to {}: {}", peer,
                                                   std::strerror(err ? err : errno)));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  c.set_timeout(timeout);
  return c;
}

Listener::~Listener() {
  if (fd >= 0) ::close(fd);
}

Result<std::unique_ptr<Listener>> listen_on(const std::string& ip, int port) {
  auto l = std::make_unique<Listener>();
  l->ip = ip;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1)
    return make_error(Errc::config, fmt::format("'{}' is not an IPv4 address to listen on", ip));
  l->fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l->fd < 0) return make_error(Errc::network, fmt::format("socket: {}", std::strerror(errno)));
  int one = 1;
  ::setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int buf = 8 << 20;
  ::setsockopt(l->fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  if (::bind(l->fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return make_error(Errc::network,
                      fmt::format("cannot listen on {}:{}: {} (is {} an address of this node?)", ip,
                                  port, std::strerror(errno), ip));
  if (::listen(l->fd, 64) != 0)
    return make_error(Errc::network, fmt::format("listen {}: {}", ip, std::strerror(errno)));
  socklen_t len = sizeof sa;
  ::getsockname(l->fd, reinterpret_cast<sockaddr*>(&sa), &len);
  l->port = ntohs(sa.sin_port);
  return l;
}

Result<std::string> make_token() {
  unsigned char b[32];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error(Errc::io, fmt::format("/dev/urandom: {}", std::strerror(errno)));
  ssize_t n = ::read(fd, b, sizeof b);
  ::close(fd);
  if (n != static_cast<ssize_t>(sizeof b)) return make_error(Errc::io, "/dev/urandom: short read");
  return to_hex(b, sizeof b);
}

bool token_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size() || a.empty()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

}  // namespace spark::stage
