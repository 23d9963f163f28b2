#include "env/bwtest.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "core/strings.h"

namespace spark::env {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

bool parse_endpoint(const std::string& s, sockaddr_in* sa) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos) return false;
  auto ip = parse_ipv4(s.substr(0, colon));
  auto port = parse_u64(s.substr(colon + 1));
  if (!ip || !port || *port > 65535) return false;
  *sa = sockaddr_in{};
  sa->sin_family = AF_INET;
  sa->sin_addr.s_addr = htonl(*ip);
  sa->sin_port = htons(static_cast<uint16_t>(*port));
  return true;
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

json receive(const std::string& on, double seconds) {
  json r = {{"on", on}, {"bytes", 0}, {"error", ""}};
  sockaddr_in sa{};
  if (!parse_endpoint(on, &sa)) {
    r["error"] = "bad listen address " + on;
    return r;
  }
  Fd l{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  int one = 1;
  ::setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(l.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(l.fd, 4) != 0) {
    r["error"] = fmt::format("listen {}: {}", on, std::strerror(errno));
    return r;
  }
  auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000) + 8000);
  pollfd p{l.fd, POLLIN, 0};
  auto left = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  if (::poll(&p, 1, left()) <= 0) {
    r["error"] = fmt::format("{}: no sender connected in time", on);
    return r;
  }
  Fd c{::accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC)};
  std::vector<char> buf(1 << 20);
  uint64_t total = 0;
  pollfd pc{c.fd, POLLIN, 0};
  while (left() > 0) {
    if (::poll(&pc, 1, left()) <= 0) break;
    ssize_t n = ::read(c.fd, buf.data(), buf.size());
    if (n <= 0) break;
    total += static_cast<uint64_t>(n);
  }
  r["bytes"] = total;
  return r;
}

json send_to(const std::string& spec, double seconds) {
  json r = {{"from", ""}, {"to", ""}, {"bytes", 0}, {"seconds", 0.0}, {"gbps", 0.0}, {"error", ""}};
  auto gt = spec.find('>');
  std::string bind_addr = gt == std::string::npos ? "" : spec.substr(0, gt);
  std::string to = gt == std::string::npos ? spec : spec.substr(gt + 1);
  r["from"] = bind_addr;
  r["to"] = to;
  sockaddr_in dst{};
  if (!parse_endpoint(to, &dst)) {
    r["error"] = "bad address " + to;
    return r;
  }
  // The receiver may start a moment later: retry the connect for up to 5 s.
  auto until = Clock::now() + std::chrono::seconds(5);
  Fd s;
  std::string last;
  while (Clock::now() < until) {
    s.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (!bind_addr.empty()) {
      sockaddr_in src{};
      if (parse_endpoint(bind_addr + ":0", &src))
        ::bind(s.fd, reinterpret_cast<sockaddr*>(&src), sizeof src);
    }
    if (::connect(s.fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0) break;
    last = std::strerror(errno);
    ::close(s.fd);
    s.fd = -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (s.fd < 0) {
    r["error"] = fmt::format("connect {}: {}", to, last);
    return r;
  }
  timeval tv{1, 0};
  ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::vector<char> buf(1 << 20, 'x');
  uint64_t total = 0;
  auto t0 = Clock::now();
  auto end = t0 + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (Clock::now() < end) {
    ssize_t n = ::send(s.fd, buf.data(), buf.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      r["error"] = fmt::format("send to {}: {}", to, std::strerror(errno));
      break;
    }
    total += static_cast<uint64_t>(n);
  }
  ::shutdown(s.fd, SHUT_WR);
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  r["bytes"] = total;
  r["seconds"] = secs;
  r["gbps"] = secs > 0 ? static_cast<double>(total) * 8 / secs / 1e9 : 0.0;
  return r;
}

}  // namespace

json run_bw_node(const BwSpec& spec) {
  std::vector<std::future<json>> rx, tx;
  for (const auto& l : spec.listen)
    rx.push_back(std::async(std::launch::async, receive, l, spec.seconds));
  for (const auto& s : spec.send)
    tx.push_back(std::async(std::launch::async, send_to, s, spec.seconds));
  json out = {{"sent", json::array()}, {"received", json::array()}};
  for (auto& f : tx) out["sent"].push_back(f.get());
  for (auto& f : rx) out["received"].push_back(f.get());
  return out;
}

}  // namespace spark::env
