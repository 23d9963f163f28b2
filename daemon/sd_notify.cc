#include "daemon/sd_notify.h"

#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

namespace spark::daemon {

Status notify_systemd(std::string_view state) {
  const char* env = std::getenv("NOTIFY_SOCKET");
  if (!env || !*env) return Status::Ok();
  const std::string path = env;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || path.size() < 2 ||
      path.size() > sizeof(addr.sun_path) - (path[0] == '/' ? 1 : 0))
    return make_error(Errc::config,
                      fmt::format("NOTIFY_SOCKET={}: not an absolute socket path or an abstract "
                                  "socket (@name) of at most {} bytes",
                                  path, sizeof(addr.sun_path) - 1));
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace: no terminating NUL
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (path[0] == '/'));
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return make_error(Errc::io, fmt::format("NOTIFY_SOCKET: socket: {}", std::strerror(errno)));
  ssize_t n;
  do {
    n = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
                 len);
  } while (n < 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  if (n < 0)
    return make_error(Errc::io, fmt::format("NOTIFY_SOCKET={}: cannot send '{}': {}", path, state,
                                            std::strerror(err)));
  return Status::Ok();
}

}  // namespace spark::daemon
