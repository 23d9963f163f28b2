// notify_systemd (sd_notify.h): the datagram reaches a socket at a path and an abstract
// socket (@name, as systemd may name it); a NOTIFY_SOCKET that is no socket address is a
// config error naming it; without NOTIFY_SOCKET nothing is sent.
#include "daemon/sd_notify.h"

#include <doctest/doctest.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>

#include "support/tempdir.h"

using namespace spark;

namespace {
// Binds a datagram socket at `name` (a leading '@': the abstract namespace).
int bind_dgram(const std::string& name) {
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, name.data(), name.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  if (name[0] == '@')
    a.sun_path[0] = '\0';
  else
    ++len;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0);
  return fd;
}
std::string recv_one(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 2000) != 1) return {};
  char buf[256];
  ssize_t n = ::recv(fd, buf, sizeof buf, 0);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}
}  // namespace

TEST_CASE("sd_notify: READY=1 reaches a path and an abstract socket; bad NOTIFY_SOCKET named") {
  test::TempDir dir;
  const std::string path = dir / "n.sock";
  int fd = bind_dgram(path);
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  REQUIRE(daemon::notify_systemd("READY=1").ok());
  CHECK(recv_one(fd) == "READY=1");
  ::close(fd);

  const std::string abstract = "@spark-notify-test-" + std::to_string(::getpid());
  fd = bind_dgram(abstract);
  ::setenv("NOTIFY_SOCKET", abstract.c_str(), 1);
  REQUIRE(daemon::notify_systemd("STOPPING=1").ok());
  CHECK(recv_one(fd) == "STOPPING=1");
  ::close(fd);

  ::setenv("NOTIFY_SOCKET", "relative.sock", 1);
  auto bad = daemon::notify_systemd("READY=1");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.code() == Errc::config);
  CHECK(bad.message().find("NOTIFY_SOCKET=relative.sock") != std::string::npos);
  ::setenv("NOTIFY_SOCKET", (dir / "nobody-listens.sock").c_str(), 1);
  auto gone = daemon::notify_systemd("READY=1");
  REQUIRE_FALSE(gone.ok());
  CHECK(gone.code() == Errc::io);
  ::unsetenv("NOTIFY_SOCKET");
  CHECK(daemon::notify_systemd("READY=1").ok());  // not under systemd: nothing to do
}
