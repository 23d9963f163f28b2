#include "daemon/engine/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace spark::engine {
namespace {

constexpr uint32_t kMaxField = 16u << 20;

bool send_all(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes, waiting at most `timeout_ms` for each piece.
bool recv_all(int fd, void* p, size_t n, int timeout_ms) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    int r = ::poll(&pf, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t got = ::recv(fd, c, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    c += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

void put_u32(std::string* s, uint32_t v) {
  s->append(reinterpret_cast<const char*>(&v), 4);
}

bool read_field(int fd, std::string* out, int timeout_ms) {
  uint32_t n = 0;
  if (!recv_all(fd, &n, 4, timeout_ms) || n > kMaxField) return false;
  out->resize(n);
  return n == 0 || recv_all(fd, out->data(), n, timeout_ms);
}

Result<sockaddr_in> resolve(const std::string& host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1) return a;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    return make_error(Errc::network, fmt::format("rendezvous store: cannot resolve host {}", host));
  a.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return a;
}

}  // namespace

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const std::string& host, int port) {
  auto addr = resolve(host, port);
  if (!addr) return addr.error();
  std::unique_ptr<TcpStoreServer> s(new TcpStoreServer());
  s->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0 ||
      ::listen(s->listen_fd_, 64) != 0)
    return make_error(
        Errc::network,
        fmt::format("rendezvous store: cannot listen on {}:{}: {} — is the port in use?", host,
                    port, std::strerror(errno)));
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = ntohs(bound.sin_port);
  if (::pipe2(s->wake_, O_CLOEXEC) != 0)
    return make_error(Errc::io, "rendezvous store: pipe failed");
  s->thread_ = std::thread([p = s.get()] { p->serve(); });
  return s;
}

TcpStoreServer::~TcpStoreServer() {
  if (wake_[1] >= 0) {
    char c = 'x';
    (void)!::write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_[0], wake_[1]})
    if (fd >= 0) ::close(fd);
}

void TcpStoreServer::serve() {
  std::vector<int> clients;
  for (;;) {
    std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (int c : clients) fds.push_back({c, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) break;
    std::vector<int> keep;
    if (fds[1].revents & POLLIN) {
      int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) keep.push_back(c);
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      const int c = fds[i].fd;
      if (!fds[i].revents) {
        keep.push_back(c);
        continue;
      }
      char op = 0;
      std::string key, value;
      bool ok = recv_all(c, &op, 1, 5000) && read_field(c, &key, 5000);
      if (ok && op == 'S') {
        ok = read_field(c, &value, 5000);
        if (ok) {
          kv_[key] = value;
          const char ack = 1;
          ok = send_all(c, &ack, 1);
        }
      } else if (ok && op == 'G') {
        auto it = kv_.find(key);
        std::string reply(1, it == kv_.end() ? '\0' : '\1');
        if (it != kv_.end()) {
          put_u32(&reply, static_cast<uint32_t>(it->second.size()));
          reply += it->second;
        }
        ok = send_all(c, reply.data(), reply.size());
      } else {
        ok = false;
      }
      if (ok)
        keep.push_back(c);
      else
        ::close(c);
    }
    clients = std::move(keep);
  }
  for (int c : clients) ::close(c);
}

Result<std::unique_ptr<TcpStoreClient>> TcpStoreClient::connect(const std::string& host, int port,
                                                                std::chrono::milliseconds timeout) {
  auto addr = resolve(host, port);
  if (!addr) return addr.error();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last;
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) == 0) {
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::unique_ptr<TcpStoreClient> c(new TcpStoreClient());
      c->fd_ = fd;
      c->where_ = fmt::format("{}:{}", host, port);
      return c;
    }
    last = std::strerror(errno);
    ::close(fd);
    if (std::chrono::steady_clock::now() >= deadline)
      return make_error(
          Errc::timeout,
          fmt::format("rendezvous store {}:{} did not accept a connection within {} ms ({}) — is "
                      "rank 0 running and the port reachable?",
                      host, port, timeout.count(), last));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

Status TcpStoreClient::roundtrip(const std::string& req, std::string* value, bool* found) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!send_all(fd_, req.data(), req.size()))
    return make_error(Errc::network,
                      fmt::format("rendezvous store {}: send failed (rank 0 gone?)", where_));
  char flag = 0;
  if (!recv_all(fd_, &flag, 1, 10000))
    return make_error(
        Errc::network,
        fmt::format("rendezvous store {}: no reply within 10 s (rank 0 gone?)", where_));
  *found = flag != 0;
  if (req[0] == 'G' && *found && !read_field(fd_, value, 10000))
    return make_error(Errc::network, fmt::format("rendezvous store {}: truncated reply", where_));
  return Status::Ok();
}

Status TcpStoreClient::set(const std::string& key, const std::string& value) {
  std::string req(1, 'S');
  put_u32(&req, static_cast<uint32_t>(key.size()));
  req += key;
  put_u32(&req, static_cast<uint32_t>(value.size()));
  req += value;
  std::string unused;
  bool ok = false;
  return roundtrip(req, &unused, &ok);
}

Result<std::optional<std::string>> TcpStoreClient::try_get(const std::string& key) {
  std::string req(1, 'G');
  put_u32(&req, static_cast<uint32_t>(key.size()));
  req += key;
  std::string value;
  bool found = false;
  SPARK_TRY(roundtrip(req, &value, &found));
  if (!found) return std::optional<std::string>();
  return std::optional<std::string>(std::move(value));
}

Status TcpStoreClient::wait(const std::vector<std::string>& keys,
                            std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      auto v = try_get(k);
      if (!v) return v.error();
      if (!v->has_value()) missing.push_back(k);
    }
    if (missing.empty()) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string names;
      for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
      return make_error(
          Errc::timeout,
          fmt::format("rendezvous store {}: keys [{}] not set within {} ms — the rank(s) "
                      "that publish them did not join",
                      where_, names, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace spark::engine
