#include "env/sysroot.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <thread>

#include "core/strings.h"

namespace spark::env {

namespace {

// A failed read, and whether it is a safety refusal (reported) or the file is just not
// there or not answerable (sysfs EINVAL on a down link: "unknown").
struct ReadOutcome {
  std::optional<std::string> data;
  Errc code = Errc::ok;
  std::string reason;  // without the path
  bool problem = false;
};

const char* kind_of(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISDIR(m)) return "a directory";
  return "not a regular file";
}

ReadOutcome errno_outcome(int e) {
  ReadOutcome o;
  if (e == ENOENT || e == ENOTDIR) {
    o.code = Errc::not_found;
    o.reason = "no such file";
  } else if (e == ELOOP) {
    o.code = Errc::io;
    o.reason = "symlink loop (ELOOP)";
    o.problem = true;
  } else {
    o.code = Errc::io;
    o.reason = std::strerror(e);
  }
  return o;
}

ReadOutcome read_now(const std::string& p, size_t cap) {
  // stat before open: opening a FIFO or a device can block or have side effects.
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return errno_outcome(errno);
  auto refuse = [](mode_t m) {
    ReadOutcome o;
    o.code = Errc::io;
    o.reason = fmt::format("{}, not a regular file: not read", kind_of(m));
    o.problem = true;
    return o;
  };
  if (!S_ISREG(st.st_mode)) return refuse(st.st_mode);
  int fd = ::open(p.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return errno_outcome(errno);
  // The path may have been replaced between stat and open.
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return refuse(st.st_mode);
  }
  std::string out;
  char buf[16384];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      ::close(fd);
      return errno_outcome(e);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > cap) {
      ::close(fd);
      ReadOutcome o;
      o.code = Errc::io;
      o.reason = fmt::format("larger than {} bytes: not read (an endless or replaced file?)", cap);
      o.problem = true;
      return o;
    }
  }
  ::close(fd);
  ReadOutcome o;
  o.data = std::move(out);
  return o;
}

}  // namespace

namespace {

// Runs fn on a detached thread; nullopt when it has not returned within `timeout` (the
// thread then finishes, or stays blocked, on its own: its state is shared, not borrowed).
template <typename T>
std::optional<T> run_bounded(std::function<T()> fn, std::chrono::milliseconds timeout) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<T> result;
  };
  auto st = std::make_shared<State>();
  try {
    std::thread([st, fn = std::move(fn)]() mutable {
      T r = fn();
      std::lock_guard<std::mutex> lock(st->mu);
      st->result.emplace(std::move(r));
      st->cv.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    return fn();  // no thread to spare: read without the deadline rather than not at all
  }
  std::unique_lock<std::mutex> lock(st->mu);
  if (!st->cv.wait_for(lock, timeout, [&] { return st->result.has_value(); })) return std::nullopt;
  return std::move(st->result);
}

std::string timeout_reason(std::chrono::milliseconds t) {
  return fmt::format("no answer within {} ms: not read", t.count());
}

}  // namespace

Result<std::string> call_with_deadline(std::function<Result<std::string>()> fn,
                                       std::chrono::milliseconds timeout) {
  auto r = run_bounded<Result<std::string>>(std::move(fn), timeout);
  if (!r) return make_error(Errc::timeout, timeout_reason(timeout));
  return std::move(*r);
}

Result<std::string> read_file_bounded(const std::string& host_path, size_t cap,
                                      std::chrono::milliseconds timeout) {
  auto o = run_bounded<ReadOutcome>([host_path, cap] { return read_now(host_path, cap); }, timeout);
  if (!o)
    return make_error(Errc::timeout, fmt::format("{}: {}", host_path, timeout_reason(timeout)));
  if (o->data) return std::move(*o->data);
  return make_error(o->code, fmt::format("{}: {}", host_path, o->reason));
}

std::string escape_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  auto cont = [&](size_t i) {
    return i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80;
  };
  size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;  // length of a valid sequence starting here (0: invalid byte)
    if (c < 0x80) {
      n = 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = cont(i + 1) ? 2 : 0;
    } else if (c >= 0xE0 && c <= 0xEF) {
      auto c1 = i + 1 < s.size() ? static_cast<unsigned char>(s[i + 1]) : 0;
      bool ok1 = c == 0xE0   ? (c1 >= 0xA0 && c1 <= 0xBF)
                 : c == 0xED ? (c1 >= 0x80 && c1 <= 0x9F)
                             : cont(i + 1);
      n = ok1 && cont(i + 2) ? 3 : 0;
    } else if (c >= 0xF0 && c <= 0xF4) {
      auto c1 = i + 1 < s.size() ? static_cast<unsigned char>(s[i + 1]) : 0;
      bool ok1 = c == 0xF0   ? (c1 >= 0x90 && c1 <= 0xBF)
                 : c == 0xF4 ? (c1 >= 0x80 && c1 <= 0x8F)
                             : cont(i + 1);
      n = ok1 && cont(i + 2) && cont(i + 3) ? 4 : 0;
    }
    if (n == 0) {
      out += fmt::format("\\x{:02X}", c);
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

Sysroot::Sysroot(std::string root) : rec_(std::make_shared<Recorder>()) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  root_ = (root == "/" || root.empty()) ? std::string() : root;
}

std::string Sysroot::path(std::string_view abs) const {
  std::string p(abs);
  if (root_.empty() && !p.empty()) return p;  // live: relative paths stay relative to the cwd
  if (p.empty() || p[0] != '/') p = "/" + p;
  return root_ + p;
}

void Sysroot::note(std::string_view abs, Kind k) const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  if (!rec_->on) return;
  (k == Kind::dir     ? rec_->dirs
   : k == Kind::sized ? rec_->sized
                      : rec_->files)
      .insert(std::string(abs));
}

void Sysroot::add_problem(std::string_view abs, std::string what) const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  for (const auto& p : rec_->problems)
    if (p.path == abs) return;
  rec_->problems.push_back({std::string(abs), std::move(what)});
}

std::vector<ReadProblem> Sysroot::problems() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->problems;
}

std::optional<std::string> Sysroot::problem(std::string_view abs) const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  for (const auto& p : rec_->problems)
    if (p.path == abs) return p.what;
  return std::nullopt;
}

std::optional<std::string> Sysroot::read(std::string_view abs, size_t cap) const {
  note(abs, Kind::file);
  bool wedged;
  {
    std::lock_guard<std::mutex> lock(rec_->mu);
    wedged = rec_->timeouts >= 3;
  }
  if (wedged) {
    add_problem(abs, "not read: three earlier reads under this root timed out");
    return std::nullopt;
  }
  std::string host = path(abs);
  auto o = run_bounded<ReadOutcome>([host, cap] { return read_now(host, cap); }, timeout_);
  if (!o) {
    {
      std::lock_guard<std::mutex> lock(rec_->mu);
      ++rec_->timeouts;
    }
    add_problem(abs, timeout_reason(timeout_));
    return std::nullopt;
  }
  if (o->data) return std::move(o->data);
  // A refusal is reported; a missing or unanswerable attribute is just "unknown".
  if (o->problem) add_problem(abs, o->reason);
  return std::nullopt;
}

std::optional<std::string> Sysroot::read_line(std::string_view abs) const {
  auto t = read(abs);
  if (!t) return std::nullopt;
  auto nl = t->find('\n');
  return escape_invalid_utf8(trim(std::string_view(*t).substr(0, nl)));
}

std::vector<std::string> Sysroot::list(std::string_view abs) const {
  note(abs, Kind::dir);
  std::vector<std::string> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(path(abs), ec), end;
  if (ec == std::errc::too_many_symbolic_link_levels) add_problem(abs, "symlink loop (ELOOP)");
  for (; !ec && it != end; it.increment(ec)) out.push_back(it->path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool Sysroot::exists(std::string_view abs) const {
  struct stat st {};
  if (::stat(path(abs).c_str(), &st) == 0) return true;
  if (errno == ELOOP) add_problem(abs, "symlink loop (ELOOP)");
  return false;
}

std::optional<uint64_t> Sysroot::file_size(std::string_view abs) const {
  note(abs, Kind::sized);
  struct stat st {};
  if (::stat(path(abs).c_str(), &st) != 0) {
    if (errno == ELOOP) add_problem(abs, "symlink loop (ELOOP)");
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

void Sysroot::record(bool on) {
  std::lock_guard<std::mutex> lock(rec_->mu);
  rec_->on = on;
}

std::set<std::string> Sysroot::recorded_files() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->files;
}

std::set<std::string> Sysroot::recorded_dirs() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->dirs;
}

std::set<std::string> Sysroot::recorded_sized() const {
  std::lock_guard<std::mutex> lock(rec_->mu);
  return rec_->sized;
}

}  // namespace spark::env
