#include "core/stage_recv.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "core/log.h"
#include "core/manifest.h"
#include "core/pagecache.h"
#include "core/stage_send.h"
#include "core/strings.h"

namespace spark::stage {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr size_t kPiece = 4u << 20;  // receive/hash/write granularity inside a chunk
constexpr int kMaxConnections = 256;
constexpr uint64_t kDirectAlign = 4096;

int64_t stat_mtime_ns(const struct stat& sb) {
  return static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000LL + sb.st_mtim.tv_nsec;
}

// Creates the parent directories of `rel` under `dir` without following symlinks.
Status make_parents(const std::string& dir, const std::string& rel) {
  auto parts = split_list(rel, '/');
  if (parts.size() <= 1) return {};
  std::string cur = dir;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    cur += "/" + parts[i];
    struct stat sb {};
    if (::lstat(cur.c_str(), &sb) == 0) {
      if (S_ISLNK(sb.st_mode))
        return make_error(Errc::integrity,
                          fmt::format("{} is a symlink on the target; staging never writes "
                                      "through links: remove it and run again",
                                      cur));
      if (!S_ISDIR(sb.st_mode))
        return make_error(Errc::io, fmt::format("{} exists and is not a directory", cur));
      continue;
    }
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return make_error(errno == EACCES ? Errc::io : Errc::io,
                        fmt::format("cannot create directory {}: {}", cur, std::strerror(errno)));
  }
  return {};
}

// Refuses `rel` under `dir` when one of its parent directories is a symlink.
Status refuse_linked_parents(const std::string& dir, const std::string& rel,
                             const std::string& node) {
  auto parts = split_list(rel, '/');
  std::string cur = dir;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    cur += "/" + parts[i];
    struct stat sb {};
    if (::lstat(cur.c_str(), &sb) != 0) return {};  // not there yet: created without links
    if (S_ISLNK(sb.st_mode))
      return make_error(Errc::integrity,
                        fmt::format("{}: {} is a symlink on the target; staging never writes "
                                    "or reads through links: remove it (or stage into the "
                                    "directory it points to) and run again",
                                    node, cur));
  }
  return {};
}

// True when bytes [off, off+len) of `path` hash to `want` (a journaled chunk whose
// durability was not yet confirmed by a "sync" line).
bool chunk_on_disk(const std::string& path, uint64_t off, uint64_t len, const std::string& want) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  std::vector<char> buf(std::min<uint64_t>(len, 8u << 20));
  bool ok = true;
  for (uint64_t done = 0; done < len && ok;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), len - done));
    ssize_t k = ::pread(fd, buf.data(), n, static_cast<off_t>(off + done));
    if (k <= 0)
      ok = false;
    else {
      XXH3_128bits_update(st, buf.data(), static_cast<size_t>(k));
      done += static_cast<uint64_t>(k);
    }
  }
  auto hv = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return ok && fmt::format("{:016x}{:016x}", hv.high64, hv.low64) == want;
}

// Per-file receive state.
struct FileState {
  std::mutex mu;
  const ManifestEntry* entry = nullptr;
  std::string final_path, partial_path, journal_path;
  std::vector<bool> verified;
  std::vector<bool> resumed;  // verified from the journal at plan time, not received now
  uint64_t remaining = 0;     // chunks not yet verified
  bool skip = false;          // already complete on the target
  bool rehome = false;        // final file exists but is damaged: move it to partial first
  bool open = false;
  bool finalized = false;
  bool failed = false;
  int fd = -1;   // buffered: unaligned tails, fsync, metadata
  int dfd = -1;  // O_DIRECT when the filesystem supports it: bulk writes skip the page cache
  int jfd = -1;
  std::string error;
  int pending_chunks = 0;  // journaled since the last fdatasync
};

// Journal: a line "INDEX HASH" per verified chunk, appended as soon as the chunk's writes
// returned, so a killed receiver loses at most the chunks it was receiving (their bytes and
// the line are in the kernel either way). Durability against a power cut costs one
// fdatasync (a device cache flush) per kJournalBatch chunks, followed by a "sync" line.
// On resume every journaled chunk is hashed again from the partial file before it is
// trusted (what does not match is sent again), and again before the final rename.
constexpr int kJournalBatch = 8;
constexpr std::string_view kJournalSync = "sync";

class ReceiverImpl final : public Receiver {
 public:
  explicit ReceiverImpl(ReceiverOptions o) : opts_(std::move(o)) {}
  ~ReceiverImpl() override {
    for (auto& f : files_) {
      if (f->fd >= 0) ::close(f->fd);
      if (f->dfd >= 0) ::close(f->dfd);
      if (f->jfd >= 0) ::close(f->jfd);
    }
  }

  Status bind() {
    for (const auto& ip : opts_.bind_ips) {
      auto l = listen_on(ip, opts_.port);
      if (!l) return l.error();
      listeners_.push_back(std::move(*l));
    }
    if (listeners_.empty()) return make_error(Errc::usage, "stage-recv: no address to listen on");
    return {};
  }

  std::vector<int> ports() const override {
    std::vector<int> p;
    for (const auto& l : listeners_) p.push_back(l->port);
    return p;
  }

  Result<std::string> run() override;

 private:
  void touch() { last_activity_.store(Clock::now().time_since_epoch().count()); }
  void stop() {
    stop_.store(true);
    std::lock_guard<std::mutex> g(conns_mu_);
    for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  void serve(int fd, std::string peer);
  void control(Conn& c);
  void data(Conn& c);
  Result<json> plan(const std::string& payload);
  Status open_file(FileState& f);
  Status finalize(FileState& f);
  Status flush_journal(FileState& f);
  Status journal_chunk(FileState& f, uint64_t index);
  void give_back(FileState& f);
  json final_report();
  void fail_session(const std::string& msg) {
    std::lock_guard<std::mutex> g(err_mu_);
    if (session_error_.empty()) session_error_ = msg;
  }

  ReceiverOptions opts_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> last_activity_{0};
  std::mutex conns_mu_;
  std::set<int> conn_fds_;
  std::atomic<int> data_streams_{0};
  std::mutex data_mu_;
  std::condition_variable data_cv_;
  std::mutex err_mu_;
  std::string session_error_;
  bool authenticated_control_ = false;
  std::mutex control_mu_;

  Manifest manifest_;
  std::atomic<bool> have_plan_{false};
  std::unique_ptr<Forwarder> forwarder_;  // chain mode: the next receiver
  std::atomic<Forwarder*> fwd_{nullptr};  // the same, as data threads read it
  std::string forward_error_;
  bool keep_cache_ = false;
  bool deep_ = false;
  std::vector<std::unique_ptr<FileState>> files_;
  std::atomic<uint64_t> chunks_received_{0}, chunks_rejected_{0}, bytes_received_{0};
  std::atomic<uint64_t> files_written_{0}, rejected_conns_{0};
  std::string report_;
  bool finished_ = false;
  Clock::time_point t0_ = Clock::now();
};

Result<json> ReceiverImpl::plan(const std::string& payload) {
  auto j = json::parse(payload, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("manifest") || !j["manifest"].is_string())
    return make_error(Errc::network, "stage-recv: the sender's MANIFEST frame is malformed");
  auto m = parse_manifest_json(j["manifest"].get<std::string>(), "sender manifest");
  if (!m) return m.error();
  manifest_ = std::move(*m);
  bool deep = j.value("deep", false);
  keep_cache_ = j.value("keep_cache", false);
  deep_ = deep;
  std::error_code ec;
  std::filesystem::create_directories(opts_.dir, ec);  // like mkdir -p
  if (ec)
    return make_error(Errc::io, fmt::format("{}: cannot create target directory {}: {}", opts_.node,
                                            opts_.dir, ec.message()));
  struct stat dsb {};
  if (::lstat(opts_.dir.c_str(), &dsb) != 0 || !S_ISDIR(dsb.st_mode))
    return make_error(Errc::io,
                      fmt::format("{}: target {} is not a directory", opts_.node, opts_.dir));
  if (::access(opts_.dir.c_str(), W_OK) != 0)
    return make_error(Errc::io, fmt::format("{}: target directory {} is not writable by this "
                                            "user ({}); fix its owner or mode",
                                            opts_.node, opts_.dir, std::strerror(errno)));
  // What the target recorded last time: lets matching files be skipped without rereading.
  std::map<std::string, ManifestEntry> recorded;
  if (auto old = read_manifest(opts_.dir); old)
    for (auto& f : old->files) recorded[f.path] = f;

  uint64_t need_bytes = 0, need_new_bytes = 0, skip_files = 0, skip_bytes = 0, resume_bytes = 0;
  uint64_t resume_mismatch = 0;  // journaled chunks whose bytes no longer match
  json files = json::array();
  for (const auto& e : manifest_.files) {
    auto f = std::make_unique<FileState>();
    f->entry = &e;
    f->final_path = opts_.dir + "/" + e.path;
    f->partial_path = f->final_path + kPartialSuffix;
    f->journal_path = f->final_path + kJournalSuffix;
    uint64_t nchunks = manifest_.chunk_count(e.size);
    f->verified.assign(nchunks, false);
    f->resumed.assign(nchunks, false);
    // A symlinked directory on the target would take writes (and the mtime fix below)
    // outside MODEL_PATH: refused before anything is looked at through it.
    SPARK_TRY(refuse_linked_parents(opts_.dir, e.path, opts_.node));
    struct stat sb {};
    if (::lstat(f->final_path.c_str(), &sb) == 0) {
      if (!S_ISREG(sb.st_mode))
        return make_error(Errc::integrity,
                          fmt::format("{}: {} exists and is not a regular file (symlink?); "
                                      "staging never writes through links: remove it",
                                      opts_.node, f->final_path));
      if (static_cast<uint64_t>(sb.st_size) == e.size) {
        auto rec = recorded.find(e.path);
        bool quick = !deep && rec != recorded.end() && rec->second.xxh3 == e.xxh3 &&
                     rec->second.size == e.size && rec->second.mtime_ns == stat_mtime_ns(sb);
        if (quick) {
          f->skip = true;
        } else {
          auto h = hash_file(f->final_path, manifest_.chunk_size, false);
          if (!h) return h.error();
          if (h->xxh3 == e.xxh3) {
            f->skip = true;
          } else {
            // Damaged in place: keep the chunks that still match, resend the rest.
            f->rehome = true;
            for (size_t c = 0; c < nchunks && c < h->chunks.size(); ++c)
              f->verified[c] = h->chunks[c] == e.chunks[c];
          }
        }
      }
    }
    if (f->skip && stat_mtime_ns(sb) != e.mtime_ns) {
      // Same content, other time (touched, or copied by another tool): take the source's
      // time so that the next run trusts size+mtime without reading the file.
      timespec ts[2];
      ts[0].tv_sec = ts[1].tv_sec = static_cast<time_t>(e.mtime_ns / 1000000000LL);
      ts[0].tv_nsec = ts[1].tv_nsec = static_cast<long>(e.mtime_ns % 1000000000LL);
      ::utimensat(AT_FDCWD, f->final_path.c_str(), ts, AT_SYMLINK_NOFOLLOW);
    }
    if (f->skip) {
      ++skip_files;
      skip_bytes += e.size;
      std::fill(f->verified.begin(), f->verified.end(), true);
      f->finalized = true;
      files.push_back(json::array());
      files_.push_back(std::move(f));
      continue;
    }
    if (!f->rehome) {
      // Resume: a partial file of the right size plus its journal of verified chunks.
      struct stat psb {};
      if (::lstat(f->partial_path.c_str(), &psb) == 0 && S_ISREG(psb.st_mode) &&
          static_cast<uint64_t>(psb.st_size) == e.size) {
        if (auto jt = read_file(f->journal_path)) {
          // Every journaled chunk is hashed again from the partial file before it is
          // trusted, synced or not: the file may have changed since (a disk error, a hand,
          // a power cut before the sync). What does not match is sent again.
          std::vector<bool> journaled(nchunks, false);
          for (const auto& line : split_list(*jt, '\n')) {
            if (line == kJournalSync) continue;
            auto sp = line.find(' ');
            if (sp == std::string::npos) continue;
            auto idx = parse_u64(line.substr(0, sp));
            if (idx && *idx < nchunks && line.substr(sp + 1) == e.chunks[*idx])
              journaled[*idx] = true;
          }
          for (uint64_t i = 0; i < nchunks; ++i) {
            if (!journaled[i]) continue;
            if (opts_.fault_trust_journal)
              f->verified[i] = f->resumed[i] = true;
            else if (chunk_on_disk(f->partial_path, manifest_.chunk_size * i,
                                   manifest_.chunk_len(e.size, i), e.chunks[i]))
              f->verified[i] = f->resumed[i] = true;
            else
              ++resume_mismatch;
          }
        }
      } else {
        need_new_bytes += e.size;
      }
    }
    json need = json::array();
    uint64_t c = 0;
    while (c < nchunks) {
      if (f->verified[c]) {
        resume_bytes += manifest_.chunk_len(e.size, c);
        ++c;
        continue;
      }
      uint64_t s = c;
      while (c < nchunks && !f->verified[c]) {
        need_bytes += manifest_.chunk_len(e.size, c);
        ++f->remaining;
        ++c;
      }
      need.push_back({s, c});
    }
    files.push_back(std::move(need));
    files_.push_back(std::move(f));
  }
  struct statvfs vs {};
  if (::statvfs(opts_.dir.c_str(), &vs) != 0)
    return make_error(
        Errc::io, fmt::format("{}: statvfs {}: {}", opts_.node, opts_.dir, std::strerror(errno)));
  json p;
  p["node"] = opts_.node;
  p["dir"] = opts_.dir;
  p["files"] = std::move(files);
  p["need_bytes"] = need_bytes;
  p["new_bytes"] = need_new_bytes;  // disk space still to be taken
  p["skip_files"] = skip_files;
  p["skip_bytes"] = skip_bytes;
  p["resume_bytes"] = resume_bytes;
  p["resume_mismatch_chunks"] = resume_mismatch;
  p["fs_total"] = static_cast<uint64_t>(vs.f_blocks) * vs.f_frsize;
  p["fs_free"] = static_cast<uint64_t>(vs.f_bavail) * vs.f_frsize;
  p["fs_used"] = static_cast<uint64_t>(vs.f_blocks - vs.f_bfree) * vs.f_frsize;
  have_plan_ = true;
  return p;
}

Status ReceiverImpl::open_file(FileState& f) {
  if (f.open) return {};
  const auto& e = *f.entry;
  SPARK_TRY(make_parents(opts_.dir, e.path));
  if (f.rehome) {
    // Move the damaged file away from its final name, then journal its good chunks.
    if (::rename(f.final_path.c_str(), f.partial_path.c_str()) != 0)
      return make_error(Errc::io, fmt::format("{}: cannot move damaged {} aside: {}", opts_.node,
                                              f.final_path, std::strerror(errno)));
    ::unlink(f.journal_path.c_str());
  }
  f.fd = ::open(f.partial_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (f.fd < 0)
    return make_error(
        Errc::io,
        fmt::format("{}: cannot create {}: {}{}", opts_.node, f.partial_path, std::strerror(errno),
                    errno == EACCES ? " (fix the directory's owner or mode)" : ""));
  struct stat sb {};
  ::fstat(f.fd, &sb);
  if (static_cast<uint64_t>(sb.st_size) != e.size) {
    if (::ftruncate(f.fd, static_cast<off_t>(e.size)) != 0)
      return make_error(Errc::io, fmt::format("{}: cannot size {}: {}", opts_.node, f.partial_path,
                                              std::strerror(errno)));
    ::unlink(f.journal_path.c_str());
  }
  // Reserve the space now so that a full disk is a clear error, not a torn write. Free
  // space is checked first: a reservation that fails half-way keeps the blocks it got.
  if (e.size > 0) {
    ::fstat(f.fd, &sb);
    const uint64_t have = static_cast<uint64_t>(sb.st_blocks) * 512;
    const uint64_t need = e.size > have ? e.size - have : 0;
    struct statvfs vs {};
    if (need > 0 && ::fstatvfs(f.fd, &vs) == 0 &&
        static_cast<uint64_t>(vs.f_bavail) * vs.f_frsize < need) {
      uint64_t free_bytes = static_cast<uint64_t>(vs.f_bavail) * vs.f_frsize;
      give_back(f);
      return make_error(
          Errc::resource,
          fmt::format("{}: disk full: {} needs {} more, the target filesystem has "
                      "{} free; free space and run again",
                      opts_.node, f.partial_path, format_size(need), format_size(free_bytes)));
    }
    int rc = ::posix_fallocate(f.fd, 0, static_cast<off_t>(e.size));
    if (rc == ENOSPC) {
      give_back(f);
      return make_error(Errc::resource,
                        fmt::format("{}: disk full: cannot reserve {} for {}; free space on "
                                    "the target filesystem and run again (verified chunks are "
                                    "kept)",
                                    opts_.node, format_size(e.size), f.partial_path));
    }
  }
  // Direct writes keep the weights out of the target's page cache (unified memory) and run
  // at the disk's direct-write rate; tmpfs and friends refuse O_DIRECT and stay buffered.
  if (manifest_.chunk_size % kDirectAlign == 0)
    f.dfd = ::open(f.partial_path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
  f.jfd =
      ::open(f.journal_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (f.jfd < 0)
    return make_error(Errc::io, fmt::format("{}: cannot create {}: {}", opts_.node, f.journal_path,
                                            std::strerror(errno)));
  if (f.rehome) {
    std::string lines;
    for (size_t c = 0; c < f.verified.size(); ++c)
      if (f.verified[c]) lines += fmt::format("{} {}\n", c, e.chunks[c]);
    if (!lines.empty() && ::write(f.jfd, lines.data(), lines.size()) < 0)
      return make_error(Errc::io, fmt::format("{}: write {}: {}", opts_.node, f.journal_path,
                                              std::strerror(errno)));
    f.rehome = false;
  }
  f.open = true;
  return {};
}

// After ENOSPC: returns to the filesystem every block of the partial file that no verified
// chunk covers (holes punched; the file keeps its size so the journal stays valid). With no
// verified chunk the partial file and its journal go. Caller holds f.mu or owns f.
void ReceiverImpl::give_back(FileState& f) {
  const auto& e = *f.entry;
  bool any = std::find(f.verified.begin(), f.verified.end(), true) != f.verified.end();
  if (!any) {
    if (f.fd >= 0 && ::ftruncate(f.fd, 0) != 0) {
      // best effort: the file is unlinked next
    }
    ::unlink(f.partial_path.c_str());
    ::unlink(f.journal_path.c_str());
    return;
  }
  for (size_t c = 0; c < f.verified.size(); ++c) {
    if (f.verified[c]) continue;
    size_t d = c;
    while (d < f.verified.size() && !f.verified[d]) ++d;
    uint64_t off = manifest_.chunk_size * c;
    uint64_t end = std::min<uint64_t>(e.size, manifest_.chunk_size * d);
    (void)::fallocate(f.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                      static_cast<off_t>(end - off));
    c = d;
  }
}

// Makes the pending chunks durable, then journals them: a journal line always names bytes
// that are on disk. Caller holds f.mu.
Status ReceiverImpl::flush_journal(FileState& f) {
  if (f.pending_chunks == 0 || f.jfd < 0) return {};
  if (::fdatasync(f.fd) != 0)
    return make_error(Errc::io, fmt::format("{}: fdatasync {}: {}", opts_.node, f.partial_path,
                                            std::strerror(errno)));
  std::string line = std::string(kJournalSync) + "\n";
  if (::write(f.jfd, line.data(), line.size()) < 0)
    return make_error(Errc::io, fmt::format("{}: journal {}: {}", opts_.node, f.journal_path,
                                            std::strerror(errno)));
  f.pending_chunks = 0;
  return {};
}

// Appends the journal line of one verified chunk (caller holds f.mu).
Status ReceiverImpl::journal_chunk(FileState& f, uint64_t index) {
  std::string line = fmt::format("{} {}\n", index, f.entry->chunks[index]);
  if (::write(f.jfd, line.data(), line.size()) < 0)
    return make_error(Errc::io, fmt::format("{}: journal {}: {}", opts_.node, f.journal_path,
                                            std::strerror(errno)));
  ++f.pending_chunks;
  return {};
}

Status ReceiverImpl::finalize(FileState& f) {
  const auto& e = *f.entry;
  if (!f.open) SPARK_TRY(open_file(f));  // empty files and fully journaled partials
  // Chunks taken from the journal were hashed at plan time; the file could have changed
  // since, so they are hashed again before it may take its final name.
  for (uint64_t i = 0; i < f.resumed.size(); ++i) {
    if (!f.resumed[i] || chunk_on_disk(f.partial_path, manifest_.chunk_size * i,
                                       manifest_.chunk_len(e.size, i), e.chunks[i]))
      continue;
    if (::ftruncate(f.jfd, 0) != 0) {
      // best effort: the error below has the file staged again either way
    }
    f.pending_chunks = 0;
    std::fill(f.verified.begin(), f.verified.end(), false);
    return make_error(Errc::integrity,
                      fmt::format("{}: chunk {} of {} no longer matches the manifest (it changed "
                                  "on disk after it was resumed); its journal was cleared, run "
                                  "stage-weights again",
                                  opts_.node, i, f.partial_path));
  }
  // Every byte was covered by a chunk hash that matched as it arrived; --deep also rereads
  // the whole file and checks its XXH3-128 before it may take its final name.
  auto h = deep_ ? hash_file(f.partial_path, manifest_.chunk_size, false)
                 : Result<FileHashes>(FileHashes{e.xxh3, {}, {}});
  if (!h) return h.error();
  if (h->xxh3 != e.xxh3) {
    if (::ftruncate(f.jfd, 0) != 0) {
      // best effort: the error below has the file staged again either way
    }
    f.pending_chunks = 0;
    std::fill(f.verified.begin(), f.verified.end(), false);
    return make_error(Errc::integrity,
                      fmt::format("{}: {} hashes to {} after all chunks matched, manifest says {}; "
                                  "its journal was cleared, run stage-weights again",
                                  opts_.node, f.partial_path, h->xxh3, e.xxh3));
  }
  if (::fsync(f.fd) != 0)
    return make_error(Errc::io, fmt::format("{}: fsync {}: {}", opts_.node, f.partial_path,
                                            std::strerror(errno)));
  ::fchmod(f.fd, e.mode & 0777);
  timespec ts[2];
  ts[0].tv_sec = ts[1].tv_sec = static_cast<time_t>(e.mtime_ns / 1000000000LL);
  ts[0].tv_nsec = ts[1].tv_nsec = static_cast<long>(e.mtime_ns % 1000000000LL);
  ::futimens(f.fd, ts);
  if (::rename(f.partial_path.c_str(), f.final_path.c_str()) != 0)
    return make_error(Errc::io, fmt::format("{}: rename {} -> {}: {}", opts_.node, f.partial_path,
                                            f.final_path, std::strerror(errno)));
  ::close(f.jfd);
  f.jfd = -1;
  ::unlink(f.journal_path.c_str());
  if (!keep_cache_) (void)evict_fd_settled(f.fd, false);
  ::close(f.fd);
  f.fd = -1;
  if (f.dfd >= 0) ::close(f.dfd);
  f.dfd = -1;
  f.finalized = true;
  ++files_written_;
  return {};
}

void ReceiverImpl::data(Conn& c) {
  std::unique_ptr<char, decltype(&std::free)> buf(
      static_cast<char*>(std::aligned_alloc(kDirectAlign, kPiece)), &std::free);
  auto send_error = [&](const std::string& msg, Errc code = Errc::io) {
    fail_session(msg);
    Header h{Frame::error, static_cast<uint8_t>(code), 0, 0, msg.size()};
    (void)c.send_frame(h, msg.data());
  };
  XXH3_state_t* st = XXH3_createState();
  for (;;) {
    auto h = c.recv_header();
    if (!h) break;
    touch();
    if (h->type == Frame::done) break;
    if (h->type != Frame::chunk || !have_plan_) {
      send_error(fmt::format("{}: unexpected frame {} on a data stream", opts_.node,
                             static_cast<int>(h->type)));
      break;
    }
    if (h->a >= files_.size()) {
      send_error(fmt::format("{}: chunk for file #{} of {}", opts_.node, h->a, files_.size()));
      break;
    }
    FileState& f = *files_[h->a];
    const auto& e = *f.entry;
    if (h->b >= f.verified.size() || h->length != manifest_.chunk_len(e.size, h->b)) {
      send_error(fmt::format("{}: {} chunk {} has a bad index or length {}", opts_.node, e.path,
                             h->b, h->length));
      break;
    }
    bool already = false;
    bool open_failed = false;
    {
      std::lock_guard<std::mutex> g(f.mu);
      already = f.finalized || f.verified[h->b];
      if (!already && !f.open) {
        if (auto s = open_file(f); !s) {
          send_error(s.message(), s.code());
          open_failed = true;
        }
      }
    }
    if (open_failed) break;
    // Chain mode: a chunk the next receiver needs is kept whole, verified, then forwarded.
    Forwarder* fwd = fwd_.load();
    const bool forward = fwd && fwd->needs(h->a, h->b);
    char* whole = nullptr;
    if (forward) {
      uint64_t cap = (h->length + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
      whole = static_cast<char*>(
          std::aligned_alloc(kDirectAlign, std::max<uint64_t>(cap, kDirectAlign)));
    }
    const bool hashing = !already || forward;
    const uint64_t off0 = h->b * manifest_.chunk_size;
    XXH3_128bits_reset(st);
    uint64_t left = h->length, off = off0;
    bool io_failed = false;
    while (left > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, kPiece));
      char* dst = forward ? whole + (off - off0) : buf.get();
      if (auto s = c.recv_all(dst, n); !s) {
        log::warn("stage-recv", "{}", s.message());
        XXH3_freeState(st);
        std::free(whole);
        return;
      }
      touch();
      if (hashing) XXH3_128bits_update(st, dst, n);
      if (!already && !io_failed) {
        size_t w = 0;
        while (w < n) {
          // Aligned pieces go direct; a file's unaligned tail goes through the page cache.
          int wfd = (f.dfd >= 0 && (n - w) % kDirectAlign == 0 && (off + w) % kDirectAlign == 0)
                        ? f.dfd
                        : f.fd;
          ssize_t k = ::pwrite(wfd, dst + w, n - w, static_cast<off_t>(off + w));
          if (k < 0 && errno == EINTR) continue;
          if (k < 0) {
            int err = errno;
            send_error(
                fmt::format("{}: {} writing {} at offset {}: {}{}", opts_.node,
                            err == ENOSPC ? "disk full" : "write failed", f.partial_path, off + w,
                            std::strerror(err), err == ENOSPC ? "; free space and run again" : ""),
                err == ENOSPC ? Errc::resource : Errc::io);
            io_failed = true;
            if (err == ENOSPC) {
              // Give back what no verified chunk covers; chunks other streams are still
              // writing into those holes are not verified afterwards (failed).
              std::lock_guard<std::mutex> g(f.mu);
              f.failed = true;
              f.error = fmt::format("disk full writing {}", f.partial_path);
              give_back(f);
            }
            break;
          }
          w += static_cast<size_t>(k);
        }
      }
      off += n;
      left -= n;
    }
    if (io_failed) {
      std::free(whole);
      break;
    }
    bytes_received_ += h->length;
    ++chunks_received_;
    AckStatus ack = AckStatus::ok;
    bool hash_ok = true;
    if (hashing) {
      auto hv = XXH3_128bits_digest(st);
      std::string got = fmt::format("{:016x}{:016x}", hv.high64, hv.low64);
      hash_ok = got == e.chunks[h->b];
      if (!hash_ok) {
        ++chunks_rejected_;
        ack = AckStatus::bad_hash;
        log::warn("stage-recv", "{}: {} chunk {} hashed {} but manifest says {}; asking again",
                  opts_.node, e.path, h->b, got, e.chunks[h->b]);
      }
    }
    if (!already && hash_ok) {
      {
        std::lock_guard<std::mutex> g(f.mu);
        bool stop_now = f.failed;
        if (!stop_now && !f.verified[h->b]) {
          f.verified[h->b] = true;
          --f.remaining;
          // (The last chunk needs no journal line: finalize fsyncs and renames.)
          if (f.remaining > 0) {
            auto s = journal_chunk(f, h->b);
            if (s && f.pending_chunks >= kJournalBatch) s = flush_journal(f);
            if (!s) {
              send_error(s.message(), s.code());
              stop_now = true;
            }
          }
          if (!stop_now && f.remaining == 0 && !f.finalized) {
            if (auto s = finalize(f); !s) {
              f.failed = true;
              f.error = s.message();
              send_error(s.message(), s.code());
              stop_now = true;
            }
          }
        }
        if (stop_now) {
          std::free(whole);
          break;
        }
      }
    }
    if (forward && hash_ok)
      fwd->push(h->a, h->b, whole, h->length);  // takes ownership; blocks while it is behind
    else
      std::free(whole);
    Header a{Frame::ack, static_cast<uint8_t>(ack), h->a, h->b, 0};
    if (!c.send_frame(a)) break;
  }
  XXH3_freeState(st);
}

json ReceiverImpl::final_report() {
  json r;
  r["node"] = opts_.node;
  r["dir"] = opts_.dir;
  json problems = json::array();
  uint64_t skipped = 0;
  for (auto& fp : files_) {
    FileState& f = *fp;
    std::lock_guard<std::mutex> g(f.mu);
    if (f.skip) ++skipped;
    if (!f.finalized && !f.failed && f.remaining == 0) {
      // Nothing left to receive (empty file, or every chunk journaled before a restart).
      if (auto s = finalize(f); !s) {
        f.failed = true;
        f.error = s.message();
      }
    }
    // Final pass: every file in the manifest is present under its final name with the
    // manifest's size and mtime (its content was hashed at rename or at plan time).
    struct stat sb {};
    std::string why;
    if (f.failed)
      why = f.error;
    else if (!f.finalized)
      why = fmt::format("{} of {} chunks still missing", f.remaining, f.verified.size());
    else if (::lstat(f.final_path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode))
      why = "missing after staging";
    else if (static_cast<uint64_t>(sb.st_size) != f.entry->size)
      why = fmt::format("size {} != {}", sb.st_size, f.entry->size);
    else if (stat_mtime_ns(sb) != f.entry->mtime_ns)
      why = "mtime was not applied";
    if (!why.empty()) problems.push_back({{"path", f.entry->path}, {"problem", why}});
  }
  bool ok = problems.empty() && session_error_.empty();
  if (ok) {
    // The target now holds exactly the source's content: record it (preflight compares it).
    Manifest m = manifest_;
    for (auto& f : m.files) {
      struct stat sb {};
      if (::lstat((opts_.dir + "/" + f.path).c_str(), &sb) == 0) f.mtime_ns = stat_mtime_ns(sb);
    }
    if (auto s = write_manifest(opts_.dir, m); !s) {
      ok = false;
      problems.push_back({{"path", kManifestName}, {"problem", s.message()}});
    }
    int dfd = ::open(opts_.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }
  r["ok"] = ok;
  r["error"] = session_error_;
  r["digest"] = manifest_.digest();
  r["files_total"] = files_.size();
  r["files_skipped"] = skipped;
  r["files_written"] = files_written_.load();
  r["chunks_received"] = chunks_received_.load();
  r["chunks_rejected"] = chunks_rejected_.load();
  r["bytes_received"] = bytes_received_.load();
  r["rejected_connections"] = rejected_conns_.load();
  r["problems"] = std::move(problems);
  r["evicted"] = !keep_cache_;
  r["seconds"] = std::chrono::duration<double>(Clock::now() - t0_).count();
  if (forwarder_) {
    r["forward_to"] = forwarder_->node();
    r["forward_bytes"] = forwarder_->bytes_sent();
    if (!forward_error_.empty()) r["forward_error"] = forward_error_;
  }
  return r;
}

void ReceiverImpl::control(Conn& c) {
  c.set_timeout(std::chrono::milliseconds(1000));
  auto wait_frame = [&]() -> Result<Header> {
    for (;;) {
      auto h = c.recv_header();
      if (h || h.error().code != Errc::timeout) return h;
      if (stop_.load()) return make_error(Errc::network, "stopped");
      auto idle = Clock::now() - Clock::time_point(Clock::duration(last_activity_.load()));
      if (idle > opts_.idle_timeout)
        return make_error(Errc::timeout,
                          fmt::format("{}: no traffic from the sender for {} s; giving up "
                                      "(partial files and journals are kept for resume)",
                                      opts_.node, opts_.idle_timeout.count() / 1000));
    }
  };
  auto reply_error = [&](const std::string& msg, Errc code = Errc::network) {
    fail_session(msg);
    Header h{Frame::error, static_cast<uint8_t>(code), 0, 0, msg.size()};
    (void)c.send_frame(h, msg.data());
  };
  auto h = wait_frame();
  if (!h || h->type != Frame::manifest) {
    fail_session(h ? "expected MANIFEST" : h.error().message);
    return;
  }
  c.set_timeout(opts_.idle_timeout);
  auto payload = c.recv_payload(*h);
  if (!payload) return fail_session(payload.error().message);
  auto p = plan(*payload);
  if (!p) return reply_error(p.error().message, p.error().code);
  std::string pt = p->dump();
  if (!c.send_frame(Header{Frame::plan, 0, 0, 0, pt.size()}, pt.data())) return;
  touch();
  c.set_timeout(std::chrono::milliseconds(1000));
  h = wait_frame();
  if (!h) return fail_session(h.error().message);
  if (h->type == Frame::forward) {
    // Chain mode: connect to the next receiver before any data arrives, then ack.
    c.set_timeout(opts_.idle_timeout);
    auto body = c.recv_payload(*h);
    if (!body) return fail_session(body.error().message);
    auto fj = json::parse(*body, nullptr, false);
    if (fj.is_discarded() || !fj.is_object() || !fj.contains("addrs") || !fj["addrs"].is_array() ||
        !fj.contains("need"))
      return reply_error("malformed FORWARD");
    TargetSpec next;
    next.node = fj.value("node", std::string("next"));
    next.token = fj.value("token", std::string());
    for (const auto& a : fj["addrs"])
      if (a.is_array() && a.size() == 2 && a[0].is_string() && a[1].is_number_unsigned())
        next.addrs.emplace_back(a[0].get<std::string>(), a[1].get<int>());
    auto f = Forwarder::start(next, manifest_, fj["need"].dump(), fj.value("streams", 4),
                              opts_.idle_timeout);
    if (!f) return reply_error(f.error().message, f.error().code);
    forwarder_ = std::move(*f);
    fwd_.store(forwarder_.get());
    if (!c.send_frame(Header{Frame::forward, 0, 0, 0, 0})) return;
    c.set_timeout(std::chrono::milliseconds(1000));
    h = wait_frame();
    if (!h) return fail_session(h.error().message);
  }
  if (h->type == Frame::abort) {
    auto why = c.recv_payload(*h);
    fail_session(fmt::format("sender aborted: {}", why ? *why : "?"));
    return;
  }
  if (h->type != Frame::finish) return reply_error("expected FINISH");
  c.set_timeout(opts_.idle_timeout);
  (void)c.recv_payload(*h);
  // Wait for the data streams to drain (the sender sent DONE on each before FINISH).
  {
    std::unique_lock<std::mutex> g(data_mu_);
    data_cv_.wait_for(g, opts_.idle_timeout, [&] { return data_streams_.load() == 0; });
  }
  if (forwarder_) {
    if (auto st = forwarder_->finish(); !st)
      forward_error_ = fmt::format("forwarding to {} failed: {}", forwarder_->node(), st.message());
  }
  auto r = final_report();
  report_ = r.dump();
  finished_ = r["ok"].get<bool>();
  (void)c.send_frame(Header{Frame::report, 0, 0, 0, report_.size()}, report_.data());
}

void ReceiverImpl::serve(int fd, std::string peer) {
  Conn c(fd, peer);
  c.set_timeout(std::chrono::milliseconds(10000));
  auto unregister = [&] {
    std::lock_guard<std::mutex> g(conns_mu_);
    conn_fds_.erase(fd);
  };
  auto h = c.recv_header();
  std::string token;
  if (h && h->type == Frame::hello && h->length == opts_.token.size()) {
    auto t = c.recv_payload(*h);
    if (t) token = *t;
  }
  if (!h || !token_equal(token, opts_.token)) {
    ++rejected_conns_;
    log::warn("stage-recv", "{}: rejected a connection from {}: no valid token", opts_.node, peer);
    unregister();
    return;
  }
  touch();
  if (h->a == 0) {
    {
      std::lock_guard<std::mutex> g(control_mu_);
      if (authenticated_control_) {
        unregister();
        return;  // one session per receiver
      }
      authenticated_control_ = true;
    }
    control(c);
    unregister();
    stop();
    return;
  }
  c.set_timeout(opts_.idle_timeout);
  ++data_streams_;
  data(c);
  {
    std::lock_guard<std::mutex> g(data_mu_);
    --data_streams_;
  }
  data_cv_.notify_all();
  unregister();
}

Result<std::string> ReceiverImpl::run() {
  touch();
  std::vector<std::thread> threads;
  int accepted = 0;
  while (!stop_.load()) {
    std::vector<pollfd> pfds;
    for (const auto& l : listeners_) pfds.push_back({l->fd, POLLIN, 0});
    int n = ::poll(pfds.data(), pfds.size(), 250);
    auto idle = Clock::now() - Clock::time_point(Clock::duration(last_activity_.load()));
    if (!authenticated_control_ && idle > opts_.idle_timeout) {
      fail_session(fmt::format("{}: no sender connected within {} s", opts_.node,
                               opts_.idle_timeout.count() / 1000));
      stop();
      break;
    }
    if (n <= 0) continue;
    for (auto& p : pfds) {
      if (!(p.revents & POLLIN)) continue;
      sockaddr_storage sa{};
      socklen_t len = sizeof sa;
      int fd = ::accept4(p.fd, reinterpret_cast<sockaddr*>(&sa), &len, SOCK_CLOEXEC);
      if (fd < 0) continue;
      if (++accepted > kMaxConnections) {
        ::close(fd);
        continue;
      }
      char host[64] = "?";
      auto* sin = reinterpret_cast<sockaddr_in*>(&sa);
      ::inet_ntop(AF_INET, &sin->sin_addr, host, sizeof host);
      std::string peer = fmt::format("sender {}:{}", host, ntohs(sin->sin_port));
      {
        std::lock_guard<std::mutex> g(conns_mu_);
        conn_fds_.insert(fd);
      }
      threads.emplace_back([this, fd, peer] { serve(fd, peer); });
    }
  }
  stop();
  for (auto& t : threads) t.join();
  // The session ended (finished, aborted or the sender vanished): keep what was verified.
  for (auto& f : files_) {
    std::lock_guard<std::mutex> g(f->mu);
    if (!f->finalized) (void)flush_journal(*f);
  }
  if (!finished_) {
    std::lock_guard<std::mutex> g(err_mu_);
    return make_error(Errc::network,
                      session_error_.empty() ? "session ended before FINISH" : session_error_);
  }
  return report_;
}

}  // namespace

Result<std::unique_ptr<Receiver>> Receiver::create(ReceiverOptions opts) {
  if (opts.token.size() < 32)
    return make_error(Errc::usage, "stage-recv: the token must be at least 32 characters");
  auto r = std::make_unique<ReceiverImpl>(std::move(opts));
  SPARK_TRY(r->bind());
  return std::unique_ptr<Receiver>(std::move(r));
}

}  // namespace spark::stage
