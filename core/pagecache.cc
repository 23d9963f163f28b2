#include "core/pagecache.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/strings.h"

namespace spark {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kWindow = 1ull << 30;  // mincore window: bounds the vector and the mapping

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

uint64_t page_size() {
  static const uint64_t ps = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return ps;
}

#ifndef __NR_cachestat
#define __NR_cachestat 451  // the same number on every architecture (generic table)
#endif
struct CachestatRange {
  uint64_t off, len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

constexpr const char* kHidden =
    "residency unknown: this user neither owns the file nor may write it, and Linux hides "
    "the page cache of such files (mincore reports them resident, cachestat refuses); run "
    "as the owner or as root to measure";

// True when mincore tells this user the truth about `fd` (the kernel's rule since 5.0:
// owner, write permission, or CAP_FOWNER; euid 0 stands for the capability).
bool mincore_truthful(int fd, const struct stat& sb) {
  if (::geteuid() == 0 || sb.st_uid == ::geteuid()) return true;
  return ::faccessat(AT_FDCWD, fmt::format("/proc/self/fd/{}", fd).c_str(), W_OK, AT_EACCESS) == 0;
}

// Counts resident pages of an open file of `size` bytes.
Status count_resident(int fd, const std::string& path, uint64_t size, FileResidency* r,
                      bool want_map) {
  const uint64_t ps = page_size();
  r->page_size = ps;
  r->size = size;
  r->pages = (size + ps - 1) / ps;
  r->resident_pages = 0;
  r->known = true;
  r->unknown_reason.clear();
  if (!want_map) {
    CachestatRange range{0, 0};  // len 0: to the end of the file
    Cachestat cs{};
    long rc = ::syscall(__NR_cachestat, fd, &range, &cs, 0);
    if (rc == 0) {
      r->resident_pages = std::min<uint64_t>(cs.nr_cache, r->pages);
      return {};
    }
    if (errno == EPERM) {
      r->known = false;
      r->unknown_reason = kHidden;
      return {};
    }
    // ENOSYS (before 6.5) and the like: mincore below.
  }
  struct stat sb {};
  if (::fstat(fd, &sb) == 0 && !mincore_truthful(fd, sb)) {
    r->known = false;
    r->unknown_reason = kHidden;
    return {};
  }
  if (want_map) r->map.assign(r->pages, false);
  std::vector<unsigned char> vec;
  for (uint64_t off = 0; off < size; off += kWindow) {
    uint64_t len = std::min(kWindow, size - off);
    void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(off));
    if (p == MAP_FAILED)
      return make_error(Errc::io, fmt::format("cannot map {}: {}", path, std::strerror(errno)));
    uint64_t n = (len + ps - 1) / ps;
    vec.resize(n);
    int rc = ::mincore(p, len, vec.data());
    int err = errno;
    ::munmap(p, len);
    if (rc != 0)
      return make_error(Errc::io, fmt::format("mincore {}: {}", path, std::strerror(err)));
    for (uint64_t i = 0; i < n; ++i) {
      if (vec[i] & 1) {
        ++r->resident_pages;
        if (want_map) r->map[off / ps + i] = true;
      }
    }
  }
  return {};
}

}  // namespace

Result<FileResidency> file_residency(const std::string& path, bool want_map) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (f.fd < 0)
    return make_error(errno == ENOENT ? Errc::not_found : Errc::io,
                      fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  struct stat sb {};
  if (::fstat(f.fd, &sb) != 0 || !S_ISREG(sb.st_mode))
    return make_error(Errc::io, fmt::format("{} is not a regular file", path));
  FileResidency r;
  r.path = path;
  SPARK_TRY(count_resident(f.fd, path, static_cast<uint64_t>(sb.st_size), &r, want_map));
  return r;
}

Result<std::vector<std::string>> expand_regular_files(const std::vector<std::string>& paths,
                                                      std::vector<std::string>* skipped,
                                                      std::vector<std::string>* unreadable) {
  auto refused = [&](const std::string& dir, const std::error_code& ec) -> Status {
    std::string why = fmt::format("{}: cannot list the directory: {}{}", dir, ec.message(),
                                  ec == std::errc::permission_denied
                                      ? " (its files were not evicted; run as a user who can "
                                        "read it, or as root)"
                                      : "");
    if (!unreadable) return make_error(Errc::io, why);
    unreadable->push_back(why);
    return {};
  };
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::error_code ec;
    auto st = fs::symlink_status(p, ec);
    if (ec == std::errc::permission_denied) {
      // It may well exist: a directory above it is closed to this user. Saying "does not
      // exist" would send the user looking for a typo.
      std::string why = fmt::format(
          "{}: cannot reach it: {} (a directory on its path is not searchable by this user; "
          "nothing under it was evicted; run as a user who can, or as root)",
          p, ec.message());
      if (!unreadable) return make_error(Errc::io, why);
      unreadable->push_back(why);
      continue;
    }
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      return make_error(Errc::io, fmt::format("cannot look at {}: {}", p, ec.message()));
    if (ec || !fs::exists(st))
      return make_error(Errc::not_found, fmt::format("{} does not exist", p));
    if (fs::is_regular_file(st)) {
      out.push_back(p);
      continue;
    }
    if (!fs::is_directory(st)) {
      if (skipped) skipped->push_back(p);
      continue;
    }
    fs::recursive_directory_iterator it(p, fs::directory_options::none, ec);
    if (ec) {
      SPARK_TRY(refused(p, ec));
      continue;
    }
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) return make_error(Errc::io, fmt::format("cannot list {}: {}", p, ec.message()));
      auto s = it->symlink_status(ec);
      if (fs::is_directory(s)) {
        // Look before descending: the iterator gives up on the whole walk otherwise.
        if (::access(it->path().c_str(), R_OK | X_OK) != 0) {
          SPARK_TRY(refused(it->path().string(), std::error_code(errno, std::generic_category())));
          it.disable_recursion_pending();
        }
        continue;
      }
      if (fs::is_regular_file(s))
        out.push_back(it->path().string());
      else if (skipped)
        skipped->push_back(it->path().string());
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<Mapper> find_mappers(const std::string& proc_root, uint64_t dev, uint64_t ino) {
  std::vector<Mapper> out;
  std::string proc = proc_root == "/" ? "/proc" : proc_root + "/proc";
  DIR* d = ::opendir(proc.c_str());
  if (!d) return out;
  const std::string want_dev = fmt::format("{:02x}:{:02x}", major(dev), minor(dev));
  const std::string want_ino = std::to_string(ino);
  while (dirent* e = ::readdir(d)) {
    auto pid = parse_u64(e->d_name);
    if (!pid) continue;
    std::ifstream maps(fmt::format("{}/{}/maps", proc, e->d_name));
    std::string line;
    bool hit = false;
    // "start-end perms offset dev inode path"
    while (!hit && std::getline(maps, line)) {
      auto fields = split_list(line, ' ');
      if (fields.size() >= 5 && fields[4] == want_ino && fields[3] == want_dev) hit = true;
    }
    if (!hit) continue;
    Mapper m;
    m.pid = static_cast<int>(*pid);
    auto comm = read_file(fmt::format("{}/{}/comm", proc, e->d_name));
    m.comm = comm ? std::string(trim(*comm)) : "?";
    out.push_back(std::move(m));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const Mapper& a, const Mapper& b) { return a.pid < b.pid; });
  return out;
}

Status evict_fd(int fd, bool writable) {
  // Dirty pages cannot be dropped: write them out and wait. sync_file_range rather than
  // fdatasync: it does not force a device cache flush and a journal commit per file, which
  // costs milliseconds per clean file (200 ms on a 40-file model) and buys no durability
  // that eviction needs.
  if (writable && ::sync_file_range(fd, 0, 0,
                                    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                        SYNC_FILE_RANGE_WAIT_AFTER) != 0)
    return make_error(Errc::io, fmt::format("sync_file_range: {}", std::strerror(errno)));
  int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0) return make_error(Errc::io, fmt::format("posix_fadvise: {}", std::strerror(rc)));
  return {};
}

Status evict_fd_settled(int fd, bool writable, int tries) {
  // DONTNEED skips pages that are transiently referenced (a read-ahead or a writeback still
  // completing, on a loaded machine): drop, look, and drop again until nothing is left.
  Status last;
  for (int k = 0; k < std::max(tries, 1); ++k) {
    last = evict_fd(fd, writable);
    if (!last) return last;
    struct stat sb {};
    if (::fstat(fd, &sb) != 0) return last;
    FileResidency r;
    if (!count_resident(fd, "", static_cast<uint64_t>(sb.st_size), &r, false) || !r.known ||
        r.resident_pages == 0)
      return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(10 * (k + 1)));
  }
  return last;
}

size_t EvictReport::problems() const {
  return unreadable.size() +
         static_cast<size_t>(std::count_if(files.begin(), files.end(), [](const EvictedFile& f) {
           return f.status != "evicted" && f.status != "unverified";
         }));
}

Result<EvictReport> evict_page_cache(const std::vector<std::string>& paths,
                                     const std::string& proc_root) {
  auto t0 = std::chrono::steady_clock::now();
  EvictReport rep;
  auto files = expand_regular_files(paths, &rep.skipped, &rep.unreadable);
  if (!files) return files.error();
  for (const auto& path : *files) {
    EvictedFile ef;
    ef.path = path;
    // Writable files are opened read-write so that their dirty pages (a file just written)
    // are written out first; anything else read-only.
    bool writable = ::access(path.c_str(), W_OK) == 0;
    Fd f{::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW)};
    if (f.fd < 0 && writable) {
      writable = false;
      f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    }
    if (f.fd < 0) {
      int err = errno;
      struct stat sb {};
      if (::stat(path.c_str(), &sb) == 0) {
        ef.size = static_cast<uint64_t>(sb.st_size);
        rep.total_bytes += ef.size;
      }
      ef.status = err == EACCES || err == EPERM ? "unreadable" : "error";
      ef.reason = err == EACCES || err == EPERM
                      ? fmt::format(
                            "not readable by this user ({}); its pages can only be "
                            "dropped by root: sync; echo 1 > /proc/sys/vm/drop_caches",
                            std::strerror(err))
                      : fmt::format("cannot open: {}", std::strerror(err));
      rep.files.push_back(std::move(ef));
      continue;
    }
    struct stat sb {};
    ::fstat(f.fd, &sb);
    ef.size = static_cast<uint64_t>(sb.st_size);
    rep.total_bytes += ef.size;
    FileResidency before;
    if (auto s = count_resident(f.fd, path, ef.size, &before, false); !s) {
      ef.status = "error";
      ef.reason = s.message();
      rep.files.push_back(std::move(ef));
      continue;
    }
    if (!before.known) {
      // Hidden from this user: drop what the kernel lets us drop and say it is unverified.
      if (auto s = evict_fd(f.fd, false); !s) {
        ef.status = "error";
        ef.reason = fmt::format("{}: {}", path, s.message());
      } else {
        ef.status = "unverified";
        ef.reason = before.unknown_reason;
      }
      rep.files.push_back(std::move(ef));
      continue;
    }
    ef.resident_before = before.resident_bytes();
    rep.bytes_before += ef.resident_before;
    if (ef.resident_before > 0) {
      if (auto s = evict_fd(f.fd, writable); !s) {
        ef.status = "error";
        ef.reason = fmt::format("{}: {}", path, s.message());
      }
      ef.synced = writable;
    }
    FileResidency after;
    if (ef.resident_before > 0) {
      if (auto s = count_resident(f.fd, path, ef.size, &after, false); !s) {
        ef.status = "error";
        ef.reason = s.message();
      }
      // Pages under writeback are dropped by a second pass once the I/O completed.
      if (after.resident_pages > 0 && writable) {
        (void)evict_fd(f.fd, true);
        (void)count_resident(f.fd, path, ef.size, &after, false);
      }
    }
    ef.resident_after = after.resident_bytes();
    rep.bytes_after += ef.resident_after;
    if (ef.status.empty()) ef.status = ef.resident_after == 0 ? "evicted" : "resident";
    if (ef.status == "resident") {
      ef.mapped_by = find_mappers(proc_root, sb.st_dev, sb.st_ino);
      if (!ef.mapped_by.empty()) {
        std::string who;
        for (const auto& m : ef.mapped_by)
          who += fmt::format("{}{} ({})", who.empty() ? "" : ", ", m.pid, m.comm);
        ef.reason = fmt::format(
            "mapped by running process(es) {}; stop them (or let them "
            "unmap the file) and evict again",
            who);
      } else {
        ef.reason =
            "pages stayed resident and no process maps the file (dirty pages still "
            "under writeback, or locked by the kernel); run evict again";
      }
    }
    rep.files.push_back(std::move(ef));
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace spark
