#include "daemon/engine/control_channel.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <thread>

namespace spark::engine {
namespace {

using clock_t_ = std::chrono::steady_clock;
constexpr uint32_t kMaxMessage = 256u << 20;
constexpr uint32_t kHello = 0x4c544353;  // "SCTL"

int ms_left(clock_t_::time_point end) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - clock_t_::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

std::string errno_text() {
  return std::strerror(errno);
}

void tune(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // plans are small
}

// Reads exactly n bytes before `end`; false on EOF, error or the deadline (*timed_out).
bool read_exact(int fd, void* p, size_t n, clock_t_::time_point end, bool* timed_out) {
  auto* c = static_cast<char*>(p);
  *timed_out = false;
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    const int r = ::poll(&pf, 1, ms_left(end));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      *timed_out = true;
      return false;
    }
    if (r < 0) return false;
    const ssize_t got = ::recv(fd, c, n, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) return false;
    c += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool write_exact(int fd, const void* p, size_t n, clock_t_::time_point end) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    pollfd pf{fd, POLLOUT, 0};
    const int r = ::poll(&pf, 1, ms_left(end));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

std::string frame(const std::string& msg) {
  std::string f(4, '\0');
  const auto n = static_cast<uint32_t>(msg.size());
  std::memcpy(f.data(), &n, 4);
  return f + msg;
}

}  // namespace

Result<std::unique_ptr<ControlChannel>> ControlChannel::connect(Collective& comm,
                                                                std::chrono::milliseconds timeout,
                                                                int socket_buffer) {
  std::unique_ptr<ControlChannel> ch(new ControlChannel());
  ch->rank_ = comm.rank();
  ch->world_ = comm.world_size();
  ch->timeout_ms_ = static_cast<int>(timeout.count());
  const auto end = clock_t_::now() + timeout;
  std::string host = comm.address().empty() ? "127.0.0.1" : comm.address();
  // Rank 0's listener address, to everyone through the data collective.
  std::array<char, 128> where{};
  int lfd = -1;
  if (ch->rank_ == 0) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    if (int e = ::getaddrinfo(host.c_str(), "0", &hints, &res); e != 0)
      return make_error(Errc::network, fmt::format("control plane: rank 0 cannot resolve its "
                                                   "address {}: {}",
                                                   host, ::gai_strerror(e)));
    lfd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd >= 0 && socket_buffer > 0)  // accepted sockets inherit it
      ::setsockopt(lfd, SOL_SOCKET, SO_SNDBUF, &socket_buffer, sizeof(socket_buffer));
    const bool ok = lfd >= 0 && ::bind(lfd, res->ai_addr, res->ai_addrlen) == 0 &&
                    ::listen(lfd, ch->world_) == 0;
    ::freeaddrinfo(res);
    if (!ok) {
      const std::string why = errno_text();
      if (lfd >= 0) ::close(lfd);
      return make_error(Errc::network,
                        fmt::format("control plane: rank 0 cannot listen on {}: {}", host, why));
    }
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
    const int port = a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                             : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    const std::string w = fmt::format("{} {}", host, port);
    std::memcpy(where.data(), w.data(), std::min(w.size(), where.size() - 1));
  }
  if (Status st = comm.broadcast(where.data(), where.size(), 0); !st.ok()) {
    if (lfd >= 0) ::close(lfd);
    return make_error(st.code(), "control plane: sharing rank 0's address: " + st.message());
  }
  const std::string w(where.data());
  const auto sp = w.rfind(' ');
  if (sp == std::string::npos) {
    if (lfd >= 0) ::close(lfd);
    return make_error(Errc::integrity, "control plane: bad address from rank 0: " + w);
  }
  const std::string rhost = w.substr(0, sp), rport = w.substr(sp + 1);
  if (ch->rank_ == 0) {
    ch->fds_.assign(static_cast<size_t>(ch->world_), -1);
    ch->out_.assign(static_cast<size_t>(ch->world_), {});
    ch->sent_.assign(static_cast<size_t>(ch->world_), 0);
    int joined = 0;
    while (joined < ch->world_ - 1) {
      pollfd pf{lfd, POLLIN, 0};
      const int r = ::poll(&pf, 1, ms_left(end));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      uint32_t hello[2] = {};
      bool late = false;
      if (!read_exact(fd, hello, sizeof(hello), end, &late) || hello[0] != kHello || hello[1] < 1 ||
          hello[1] >= static_cast<uint32_t>(ch->world_) || ch->fds_[hello[1]] >= 0) {
        ::close(fd);  // not a rank of this ring (or a duplicate): ignore it
        continue;
      }
      tune(fd);
      ch->fds_[hello[1]] = fd;
      ++joined;
    }
    ::close(lfd);
    if (joined < ch->world_ - 1) {
      std::string missing;
      for (int r = 1; r < ch->world_; ++r)
        if (ch->fds_[static_cast<size_t>(r)] < 0)
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      return make_error(Errc::timeout,
                        fmt::format("control plane: rank(s) {} did not connect to rank 0 at "
                                    "{}:{} within {} ms",
                                    missing, rhost, rport, timeout.count()));
    }
    return ch;
  }
  // A follower: connect (rank 0 listens already: it shared the port after listen()).
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  if (int e = ::getaddrinfo(rhost.c_str(), rport.c_str(), &hints, &res); e != 0)
    return make_error(Errc::network, fmt::format("control plane: rank {} cannot resolve rank 0's "
                                                 "address {}: {}",
                                                 ch->rank_, rhost, ::gai_strerror(e)));
  int fd = -1;
  std::string why;
  while (fd < 0) {
    fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && socket_buffer > 0)  // before connect: it sets the window
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &socket_buffer, sizeof(socket_buffer));
    if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) break;
    why = errno_text();
    if (fd >= 0) ::close(fd);
    fd = -1;
    if (ms_left(end) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(res);
  if (fd < 0)
    return make_error(Errc::network,
                      fmt::format("control plane: rank {} cannot connect to rank 0 at {}:{}: {}",
                                  ch->rank_, rhost, rport, why));
  tune(fd);
  const uint32_t hello[2] = {kHello, static_cast<uint32_t>(ch->rank_)};
  if (!write_exact(fd, hello, sizeof(hello), end)) {
    ::close(fd);
    return make_error(Errc::network, fmt::format("control plane: rank {}: rank 0 at {}:{} closed "
                                                 "the connection",
                                                 ch->rank_, rhost, rport));
  }
  ch->fds_ = {fd};
  return ch;
}

ControlChannel::~ControlChannel() {
  close();
}

void ControlChannel::close() {
  for (int& fd : fds_)
    if (fd >= 0) {
      ::close(fd);
      fd = -1;
    }
}

bool ControlChannel::pending() const {
  for (size_t r = 0; r < out_.size(); ++r)
    if (sent_[r] < out_[r].size()) return true;
  return false;
}

Status ControlChannel::write_some(int peer, bool wait) {
  const size_t p = static_cast<size_t>(peer);
  std::string& buf = out_[p];
  const int fd = fds_[p];
  if (fd < 0)
    return make_error(Errc::network, fmt::format("control plane: the connection to rank {} is "
                                                 "closed",
                                                 peer));
  const auto end = clock_t_::now() + std::chrono::milliseconds(timeout_ms_);
  while (sent_[p] < buf.size()) {
    const ssize_t w =
        ::send(fd, buf.data() + sent_[p], buf.size() - sent_[p], MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      sent_[p] += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait) break;
      pollfd pf{fd, POLLOUT, 0};
      const int r = ::poll(&pf, 1, ms_left(end));
      if (r == 0)
        return make_error(Errc::timeout,
                          fmt::format("control plane: rank {} took no step plan for {} ms "
                                      "(its engine is stuck or its host unreachable)",
                                      peer, timeout_ms_));
      continue;
    }
    std::string report = read_report(peer, 0);
    return make_error(Errc::network,
                      report.empty()
                          ? fmt::format("control plane: rank {} closed its connection to rank 0 "
                                        "({}): the rank stopped or its host is unreachable",
                                        peer, errno_text())
                          : report);
  }
  if (sent_[p] == buf.size()) {
    buf.clear();
    sent_[p] = 0;
  }
  return Status::Ok();
}

Status ControlChannel::post(const std::string& msg, bool wait) {
  // A follower that left wrote its reason first: name it rather than a broken pipe.
  if (std::string r = reports(std::chrono::milliseconds(0)); !r.empty())
    return make_error(Errc::internal, r);
  const std::string f = frame(msg);
  for (int peer = 1; peer < world_; ++peer) {
    SPARK_TRY(write_some(peer, true));  // the rest of an earlier plan first, in order
    out_[static_cast<size_t>(peer)] = f;
    SPARK_TRY(write_some(peer, wait));
  }
  if (pending()) ++deferred_;
  return Status::Ok();
}

Status ControlChannel::flush() {
  for (int peer = 1; peer < world_; ++peer) SPARK_TRY(write_some(peer, true));
  return Status::Ok();
}

std::string ControlChannel::read_report(int peer, int timeout_ms) {
  const int fd = fds_[static_cast<size_t>(peer)];
  if (fd < 0) return {};
  pollfd pf{fd, POLLIN, 0};
  if (::poll(&pf, 1, timeout_ms) <= 0 || !(pf.revents & POLLIN)) return {};
  uint32_t n = 0;
  bool late = false;
  const auto end = clock_t_::now() + std::chrono::milliseconds(std::max(timeout_ms, 100));
  if (!read_exact(fd, &n, 4, end, &late) || n == 0 || n > 65536) return {};
  std::string s(n, '\0');
  if (!read_exact(fd, s.data(), n, end, &late)) return {};
  return s;
}

std::string ControlChannel::reports(std::chrono::milliseconds grace) {
  std::string all;
  if (rank_ != 0) return all;
  for (int peer = 1; peer < world_; ++peer) {
    std::string r = read_report(peer, static_cast<int>(grace.count()));
    if (!r.empty()) all += (all.empty() ? "" : "; ") + r;
  }
  return all;
}

Result<std::string> ControlChannel::next(bool* arrived) {
  const int fd = fds_.empty() ? -1 : fds_[0];
  if (fd < 0)
    return make_error(
        Errc::network,
        fmt::format("control plane: rank {}'s connection to rank 0 is closed", rank_));
  pollfd pf{fd, POLLIN, 0};
  int r = 0;
  do r = ::poll(&pf, 1, 0);
  while (r < 0 && errno == EINTR);
  *arrived = r > 0;
  const auto end = clock_t_::now() + std::chrono::milliseconds(timeout_ms_);
  uint32_t n = 0;
  bool late = false;
  if (!read_exact(fd, &n, 4, end, &late)) {
    if (late)
      return make_error(Errc::timeout,
                        fmt::format("control plane: rank {} got no step plan or heartbeat from "
                                    "rank 0 within {} ms: rank 0 is stuck or unreachable",
                                    rank_, timeout_ms_));
    return make_error(Errc::network, fmt::format("control plane: rank 0 closed the connection to "
                                                 "rank {}: its engine stopped or failed",
                                                 rank_));
  }
  if (n > kMaxMessage)
    return make_error(Errc::integrity,
                      fmt::format("control plane: rank {} got a {}-byte message from rank 0 "
                                  "(limit {}): the stream is out of step",
                                  rank_, n, kMaxMessage));
  std::string msg(n, '\0');
  if (n > 0 && !read_exact(fd, msg.data(), n, end, &late))
    return make_error(late ? Errc::timeout : Errc::network,
                      fmt::format("control plane: rank {}: a {}-byte step plan from rank 0 was "
                                  "cut off ({})",
                                  rank_, n, late ? "deadline" : "connection closed"));
  return msg;
}

void ControlChannel::report(const std::string& why) {
  if (fds_.empty() || fds_[0] < 0) return;
  const std::string f = frame(why.substr(0, 65536));
  (void)write_exact(fds_[0], f.data(), f.size(), clock_t_::now() + std::chrono::milliseconds(1000));
}

}  // namespace spark::engine
