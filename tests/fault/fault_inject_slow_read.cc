// FAULT INJECTION ONLY: an LD_PRELOAD shim that makes reads of chosen files slow, as a
// contended or failing disk does, so that a test can stop sparkd while it is provably in the
// middle of loading weights (the load does not race the test: each read takes as long as
// the test says). Environment:
//   SPARK_FAULT_SLOW_READ_MS      extra time every pread() of a matching file takes
//   SPARK_FAULT_SLOW_READ_SUFFIX  which files match (path suffix; default ".safetensors")
//   SPARK_FAULT_SLOW_READ_LOG     a file that gets "<offset> <bytes>\n" per slowed read,
//                                 written before the delay starts (where the loader is)
// Without SPARK_FAULT_SLOW_READ_MS every call goes straight to the C library.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

using PreadFn = ssize_t (*)(int, void*, size_t, off_t);

PreadFn real_pread() {
  static PreadFn fn = reinterpret_cast<PreadFn>(dlsym(RTLD_NEXT, "pread"));
  return fn;
}

bool matches(int fd) {
  const char* suffix = std::getenv("SPARK_FAULT_SLOW_READ_SUFFIX");
  const std::string want = suffix && *suffix ? suffix : ".safetensors";
  char link[64], path[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, path, sizeof path - 1);
  if (n <= 0) return false;
  const std::string p(path, static_cast<size_t>(n));
  return p.size() >= want.size() && p.compare(p.size() - want.size(), want.size(), want) == 0;
}

// Sleeps the whole time: a signal that lands on this thread does not shorten it (a read
// of a regular file is not interrupted by signals either).
void hold(long ms) {
  timespec left{ms / 1000, (ms % 1000) * 1000000L};
  while (::nanosleep(&left, &left) != 0 && errno == EINTR) {
  }
}

void note(off_t off, size_t bytes) {
  const char* log = std::getenv("SPARK_FAULT_SLOW_READ_LOG");
  if (!log || !*log) return;
  const int fd = ::open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  char line[64];
  const int n = std::snprintf(line, sizeof line, "%lld %zu\n", static_cast<long long>(off), bytes);
  if (n > 0) (void)!::write(fd, line, static_cast<size_t>(n));
  ::close(fd);
}

ssize_t slow_pread(int fd, void* buf, size_t count, off_t off) {
  const char* ms = std::getenv("SPARK_FAULT_SLOW_READ_MS");
  if (ms && *ms && matches(fd)) {
    const int saved = errno;
    note(off, count);
    hold(std::atol(ms));
    errno = saved;
  }
  return real_pread()(fd, buf, count, off);
}

}  // namespace

extern "C" {

ssize_t pread(int fd, void* buf, size_t count, off_t off) {
  return slow_pread(fd, buf, count, off);
}

ssize_t pread64(int fd, void* buf, size_t count, off_t off) {
  return slow_pread(fd, buf, count, off);
}

}  // extern "C"
