#pragma once
// Page-cache residency and eviction without root. On unified-memory nodes (GB10) the page
// cache competes with the GPU: weights just copied or read keep RAM busy until evicted.
// Residency is measured with cachestat(2) (Linux 6.5+), else mmap + mincore; eviction writes
// dirty pages out (sync_file_range) then posix_fadvise(POSIX_FADV_DONTNEED), verified the
// same way. Pages a running process has mapped cannot be dropped: those processes are found
// through <root>/proc/*/maps.
//
// Linux hides the page cache of a file from a user who neither owns it nor may write it
// (a side channel otherwise): since 5.0 mincore reports every page of such a file as
// resident, and cachestat refuses with EPERM. No other interface an unprivileged user has
// (/proc/self/*, /proc/meminfo, /proc/kpageflags needs root) tells one file's residency.
// Such files are reported as "unknown", never as resident; DONTNEED still drops their clean,
// unmapped pages (the kernel allows that on a read-only descriptor).
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark {

/// Residency of one file.
struct FileResidency {
  std::string path;
  uint64_t size = 0;
  uint64_t pages = 0;
  uint64_t resident_pages = 0;
  uint64_t page_size = 4096;
  std::vector<bool> map;  // per page, only when asked for (cache-stat -v)
  bool known = true;      // false: the kernel does not tell this user (see above)
  std::string unknown_reason;
  uint64_t resident_bytes() const { return std::min<uint64_t>(resident_pages * page_size, size); }
};

/// Measures one regular file (mmap PROT_READ + mincore in 1 GiB windows).
Result<FileResidency> file_residency(const std::string& path, bool want_map = false);

/// Expands paths into regular files (directories recursively, symlinks not followed and
/// reported as skipped). Missing paths are errors naming them. A directory that cannot be
/// listed, or a path behind a directory this user may not search, goes to *unreadable as
/// "PATH: reason" (an error for the caller to report, never a silent skip); without
/// `unreadable` it is an error.
Result<std::vector<std::string>> expand_regular_files(
    const std::vector<std::string>& paths, std::vector<std::string>* skipped,
    std::vector<std::string>* unreadable = nullptr);

/// A process that maps a file.
struct Mapper {
  int pid = 0;
  std::string comm;
};

/// Processes whose <root>/proc/PID/maps map the file with this device and inode.
std::vector<Mapper> find_mappers(const std::string& proc_root, uint64_t dev, uint64_t ino);

/// What eviction did to one file.
struct EvictedFile {
  std::string path;
  uint64_t size = 0;
  uint64_t resident_before = 0;  // bytes
  uint64_t resident_after = 0;
  bool synced = false;  // dirty pages were written out first (writable file)
  std::string status;   // evicted | unverified | resident | unreadable | error
  std::string reason;   // why it stayed resident / what failed, with the remedy
  std::vector<Mapper> mapped_by;
};

/// Eviction over a set of files.
struct EvictReport {
  std::vector<EvictedFile> files;
  std::vector<std::string> skipped;     // symlinks and special files
  std::vector<std::string> unreadable;  // directories that could not be listed ("DIR: why")
  uint64_t bytes_before = 0;
  uint64_t bytes_after = 0;
  uint64_t total_bytes = 0;
  double seconds = 0;
  /// Files that stayed (partly) resident or could not be handled, plus unreadable
  /// directories. "unverified" files (evicted, residency hidden from this user) are not.
  size_t problems() const;
};

/// Evicts the page cache of every regular file under `paths`. proc_root is "/" on a live
/// node (a captured tree in tests). Never needs root; root-owned unreadable files are
/// reported with the drop_caches remedy.
Result<EvictReport> evict_page_cache(const std::vector<std::string>& paths,
                                     const std::string& proc_root = "/");

/// Evicts one open file descriptor's pages (dirty pages written out and waited for when
/// writable, then DONTNEED).
/// Used by stage-weights on the files it wrote and read.
Status evict_fd(int fd, bool writable);

/// evict_fd, repeated (up to `tries` times, with a short growing pause) while pages of the
/// file are still resident: DONTNEED is advisory and skips pages that are busy at that moment.
Status evict_fd_settled(int fd, bool writable, int tries = 8);

}  // namespace spark
