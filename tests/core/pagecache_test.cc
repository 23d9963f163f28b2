#include "core/pagecache.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <grp.h>
#include <linux/magic.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;

namespace {

// Page-cache behaviour needs a real filesystem: tmpfs pages cannot be evicted.
bool on_real_fs(const std::string& dir) {
  struct statfs s {};
  if (::statfs(dir.c_str(), &s) != 0) return false;
  return s.f_type != TMPFS_MAGIC && s.f_type != RAMFS_MAGIC;
}

std::string write_file(const test::TempDir& d, const std::string& name, size_t n) {
  std::string data(n, 'x');
  for (size_t i = 0; i < n; i += 4096) data[i] = static_cast<char>(i / 4096);
  return d.write(name, data);
}

void read_all(const std::string& p) {
  auto s = read_file(p);
  REQUIRE(s.has_value());
}

// Runs `fn` in a child that is the user nobody (uid and gid 65534, no supplementary groups:
// what a user sees, not root's groups) and returns what it returned; "child: ..." when the
// child could not become nobody or died.
std::string as_nobody(const std::function<std::string()>& fn) {
  int out[2];
  if (::pipe(out) != 0) return "child: pipe failed";
  pid_t child = ::fork();
  if (child < 0) return "child: fork failed";
  if (child == 0) {
    ::close(out[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) {
      (void)!::write(out[1], "child: cannot become nobody", 27);
      ::_exit(3);
    }
    std::string s = fn();
    (void)!::write(out[1], s.data(), s.size());
    ::_exit(0);
  }
  ::close(out[1]);
  std::string got;
  char buf[1024];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status)) return "child: died: " + got;
  return got;
}

}  // namespace

TEST_CASE("residency: read files are resident, evicted files have zero resident pages") {
  test::TempDir d("spark-pagecache");
  if (!on_real_fs(d.path())) {
    MESSAGE("SKIP: " << d.path() << " is tmpfs/ramfs; page-cache eviction needs a real filesystem");
    return;
  }
  auto a = write_file(d, "a.safetensors", 8 << 20);
  auto b = write_file(d, "sub/b.bin", 1 << 20);
  read_all(a);
  read_all(b);
  auto ra = file_residency(a);
  REQUIRE(ra.ok());
  CHECK(ra->pages == (8u << 20) / ra->page_size);
  CHECK(ra->resident_pages == ra->pages);  // just written and read: all in the cache

  auto rep = evict_page_cache({d.path()});
  REQUIRE(rep.ok());
  CHECK(rep->files.size() == 2);
  CHECK(rep->bytes_before >= (9u << 20));
  CHECK(rep->bytes_after == 0);
  CHECK(rep->problems() == 0);
  for (const auto& f : rep->files) {
    CHECK(f.status == "evicted");
    CHECK(f.resident_after == 0);
    CHECK(f.synced);  // writable by us: dirty pages written out before DONTNEED
  }
  auto ra2 = file_residency(a, true);
  REQUIRE(ra2.ok());
  CHECK(ra2->resident_pages == 0);
  CHECK(ra2->map.size() == ra2->pages);
}

TEST_CASE("a file mapped and locked by another process is reported as mapped, with its pid") {
  test::TempDir d("spark-pagecache");
  if (!on_real_fs(d.path())) {
    MESSAGE("SKIP: " << d.path() << " is tmpfs/ramfs");
    return;
  }
  auto p = write_file(d, "held.safetensors", 2 << 20);
  auto free_one = write_file(d, "free.bin", 1 << 20);
  read_all(free_one);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The holder: maps the file, locks and touches every page, then waits to be killed.
    int fd = ::open(p.c_str(), O_RDONLY);
    void* m = ::mmap(nullptr, 2 << 20, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) ::_exit(1);
    ::mlock(m, 2 << 20);
    volatile char sum = 0;
    for (size_t i = 0; i < (2u << 20); i += 4096)
      sum = static_cast<char>(sum + static_cast<char*>(m)[i]);
    (void)sum;
    char c = 'r';
    (void)!::write(ready[1], &c, 1);
    for (int i = 0; i < 600; ++i) ::sleep(1);  // bounded: killed long before
    ::_exit(0);
  }
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  auto rep = evict_page_cache({d.path()});
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  REQUIRE(rep.ok());
  REQUIRE(rep->files.size() == 2);
  const auto& held = rep->files[1].path == p ? rep->files[1] : rep->files[0];
  const auto& other = rep->files[1].path == p ? rep->files[0] : rep->files[1];
  CHECK(held.status == "resident");
  CHECK(held.resident_after > 0);
  REQUIRE(held.mapped_by.size() >= 1);
  CHECK(held.mapped_by[0].pid == child);
  CHECK(held.reason.find(std::to_string(child)) != std::string::npos);
  CHECK(other.status == "evicted");
  CHECK(rep->problems() == 1);
}

TEST_CASE("find_mappers reads a captured /proc tree (sysroot seam)") {
  test::TempDir root("spark-procroot");
  root.write("proc/4242/maps",
             "7f0000000000-7f0000100000 r--s 00000000 fd:01 123456 /models/x.safetensors\n"
             "7f0000100000-7f0000200000 r-xp 00000000 fd:01 999 /usr/lib/libc.so\n");
  root.write("proc/4242/comm", "vllm\n");
  root.write("proc/77/maps", "7f0000000000-7f0000100000 r--s 00000000 fd:02 123456 /other\n");
  root.write("proc/77/comm", "other\n");
  root.write("proc/self/maps", "");
  auto m = find_mappers(root.path(), makedev(0xfd, 1), 123456);
  REQUIRE(m.size() == 1);
  CHECK(m[0].pid == 4242);
  CHECK(m[0].comm == "vllm");
  CHECK(find_mappers(root.path(), makedev(0xfd, 1), 5).empty());
}

TEST_CASE("an unreadable file is reported with the drop_caches remedy, not skipped") {
  if (::geteuid() != 0) {
    MESSAGE("SKIP: needs root to create a file this user cannot read");
    return;
  }
  // Root reads everything; drop privileges in a child to see what a user sees.
  test::TempDir d("spark-pagecache");
  auto p = write_file(d, "root-only.bin", 4096);
  REQUIRE(::chmod(p.c_str(), 0600) == 0);
  REQUIRE(::chmod(d.path().c_str(), 0755) == 0);
  std::string s = as_nobody([&] {
    auto rep = evict_page_cache({p});
    if (!rep.ok()) return "error: " + rep.error().message;
    if (rep->files.size() != 1)
      return fmt::format("{} files; unreadable: {}", rep->files.size(),
                         rep->unreadable.empty() ? "" : rep->unreadable[0]);
    return rep->files[0].status + "|" + rep->files[0].reason;
  });
  // A directory above the temporary one that nobody may search (a chroot made with
  // mktemp -d is 0700) shows here as "cannot reach it", not as this check passing.
  INFO(s);
  CHECK(s.find("unreadable|") == 0);
  CHECK(s.find("drop_caches") != std::string::npos);
}

TEST_CASE("a path behind a directory this user may not search is unreadable, not missing") {
  if (::geteuid() != 0) {
    MESSAGE("SKIP: needs root to make a directory this user cannot search");
    return;
  }
  test::TempDir d("spark-pagecache");
  REQUIRE(::chmod(d.path().c_str(), 0700) == 0);  // root's alone; the file itself is open
  auto p = write_file(d, "weights.bin", 4096);
  REQUIRE(::chmod(p.c_str(), 0644) == 0);
  std::string s = as_nobody([&] {
    std::string out;
    auto rep = evict_page_cache({p});
    if (!rep.ok()) return "evict error: " + rep.error().message;
    out += fmt::format("files={} problems={} ", rep->files.size(), rep->problems());
    for (const auto& u : rep->unreadable) out += "[" + u + "]";
    // Without a list to put it in, it is an error, and not a "not found" one.
    auto bare = expand_regular_files({p}, nullptr);
    out += bare.ok() ? " bare=ok"
                     : fmt::format(" bare={}:{}",
                                   bare.error().code == Errc::not_found ? "not_found" : "other",
                                   bare.error().message);
    return out;
  });
  INFO(s);
  CHECK(s.find("files=0 problems=1 [" + p + ": cannot reach it: ") == 0);
  CHECK(s.find("not searchable by this user") != std::string::npos);
  CHECK(s.find("bare=other:" + p + ": cannot reach it") != std::string::npos);
  CHECK(s.find("does not exist") == std::string::npos);
}

TEST_CASE("evict and cache-stat as a user who cannot write the files (real uid: nobody)") {
  if (::geteuid() != 0) {
    MESSAGE("SKIP: needs root to create root-owned files and switch to the user nobody");
    return;
  }
  struct passwd* pw = ::getpwnam("nobody");
  if (!pw) {
    MESSAGE("SKIP: no user 'nobody' on this machine");
    return;
  }
  test::TempDir d("spark-evict-ro");
  ::chmod(d.path().c_str(), 0755);
  // A root-owned file others may read, cached; and a directory others cannot enter.
  std::string f = d.write("weights.bin", std::string(2u << 20, 'w'));
  ::chmod(f.c_str(), 0644);
  std::filesystem::create_directories(d / "private");
  d.write("private/hidden.bin", "h");
  ::chmod((d / "private").c_str(), 0700);
  {
    // Clean pages, as weights copied earlier are (dirty ones only their writer can flush).
    int wfd = ::open(f.c_str(), O_RDONLY);
    REQUIRE(::fsync(wfd) == 0);
    ::close(wfd);
  }
  REQUIRE(read_file(f));  // into the page cache
  auto cached = file_residency(f);
  REQUIRE(cached.ok());
  REQUIRE(cached->known);
  REQUIRE(cached->resident_pages > 0);

  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipefd[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(pw->pw_gid) != 0 || ::setuid(pw->pw_uid) != 0)
      ::_exit(3);
    std::string out;
    auto r = file_residency(f);
    out += r.ok() ? (r->known ? "known" : "unknown") : "error";
    auto rep = evict_page_cache({d.path()});
    if (!rep.ok()) {
      out += " evict-error";
    } else {
      for (const auto& ef : rep->files)
        if (ef.path == f) out += " " + ef.status;
      out += " unreadable=" + std::to_string(rep->unreadable.size());
      out += " problems=" + std::to_string(rep->problems());
      if (!rep->unreadable.empty() && rep->unreadable[0].find("private") != std::string::npos)
        out += " names-dir";
    }
    (void)!::write(pipefd[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string got;
  char buf[256];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  INFO(got);
  // Not "100% resident": the kernel hides it from this user, and we say so.
  CHECK(got.rfind("unknown unverified", 0) == 0);
  CHECK(got.find("unreadable=1") != std::string::npos);
  CHECK(got.find("names-dir") != std::string::npos);
  CHECK(got.find("problems=1") != std::string::npos);  // the directory, not the file
  // The eviction itself worked: root sees the pages gone.
  auto after = file_residency(f);
  REQUIRE(after.ok());
  CHECK(after->resident_pages == 0);
}
