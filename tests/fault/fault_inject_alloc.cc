// FAULT INJECTION ONLY: an LD_PRELOAD shim that replaces the global operator new so that a
// large allocation fails with std::bad_alloc, as it does on a machine whose memory is
// spent, while every small one succeeds (the process keeps serving). A test uses it to make
// an allocation inside a chosen piece of work throw (a chat template render that builds a
// string of tens of MiB) without touching the code under test. Environment:
//   SPARK_FAULT_ALLOC_OVER  allocations of at least this many bytes throw std::bad_alloc
//   SPARK_FAULT_ALLOC_LOG   a file that gets "<bytes>\n" per refused allocation (the test
//                           checks that the fault fired)
// Without SPARK_FAULT_ALLOC_OVER every allocation goes to malloc as usual.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <new>

namespace {

size_t refuse_from() {
  static const size_t n = [] {
    const char* v = std::getenv("SPARK_FAULT_ALLOC_OVER");
    if (!v || !*v) return static_cast<size_t>(0);
    return static_cast<size_t>(std::strtoull(v, nullptr, 10));
  }();
  return n;
}

// Called on the allocating thread; open/write/close allocate nothing.
void note(size_t bytes) {
  const char* log = std::getenv("SPARK_FAULT_ALLOC_LOG");
  if (!log || !*log) return;
  const int fd = ::open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  char line[32];
  const int n = std::snprintf(line, sizeof line, "%zu\n", bytes);
  if (n > 0) (void)!::write(fd, line, static_cast<size_t>(n));
  ::close(fd);
}

void* allocate(size_t n) {
  const size_t limit = refuse_from();
  if (limit > 0 && n >= limit) {
    note(n);
    throw std::bad_alloc();
  }
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

}  // namespace

// The aligned forms stay the C++ library's (they allocate and free on their own); these
// pair malloc with free, as the library's defaults do.
void* operator new(size_t n) {
  return allocate(n);
}
void* operator new[](size_t n) {
  return allocate(n);
}
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  try {
    return allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, size_t) noexcept {
  std::free(p);
}
