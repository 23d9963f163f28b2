#include "core/process.h"

#include <errno.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

extern char** environ;

namespace spark {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A file descriptor closed on scope exit.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read, write;
};

Status make_pipe(Pipe* p) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0)
    return make_error(Errc::resource, fmt::format("pipe2: {}", std::strerror(errno)));
  p->read.reset(fds[0]);
  p->write.reset(fds[1]);
  return {};
}

// argv and envp prepared before fork: the child only calls async-signal-safe functions.
struct Prepared {
  std::vector<std::string> storage_env;
  std::vector<char*> argv;
  std::vector<char*> envp;
  const char* cwd = nullptr;
  const char* program = nullptr;
  bool die_with_parent = false;
  pid_t parent = 0;
  bool switch_user = false;  // set groups, gid, uid before the exec
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
};

// The user `uid` as the child should become: name, home and groups from the user database
// when it has an entry (getpwuid_r, getgrouplist), else only `gid`.
void resolve_user(uid_t uid, gid_t gid, Prepared* p, std::map<std::string, std::string>* env) {
  p->switch_user = true;
  p->uid = uid;
  p->gid = gid;
  p->groups = {gid};
  std::vector<char> buf(16384);
  passwd pw{}, *found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return;
  int n = 64;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) {
    groups.resize(static_cast<size_t>(n));
    if (::getgrouplist(pw.pw_name, gid, groups.data(), &n) < 0) n = 0;
  }
  if (n > 0) p->groups.assign(groups.begin(), groups.begin() + n);
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"HOME", pw.pw_dir},
                             {"USER", pw.pw_name},
                             {"LOGNAME", pw.pw_name}})
    env->emplace(k, v);  // what the caller set stays
}

Prepared prepare(const ProcessSpec& spec) {
  Prepared p;
  std::map<std::string, std::string> env = spec.env;
  if (spec.run_as_uid >= 0)
    resolve_user(static_cast<uid_t>(spec.run_as_uid), static_cast<gid_t>(spec.run_as_gid), &p,
                 &env);
  for (const auto& a : spec.argv) p.argv.push_back(const_cast<char*>(a.c_str()));
  p.argv.push_back(nullptr);
  p.program = spec.argv.empty() ? "" : spec.argv[0].c_str();
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    std::string key(kv.substr(0, eq));
    if (!env.count(key)) p.storage_env.emplace_back(kv);
  }
  for (const auto& [k, v] : env) p.storage_env.push_back(k + "=" + v);
  for (auto& s : p.storage_env) p.envp.push_back(s.data());
  p.envp.push_back(nullptr);
  if (!spec.cwd.empty()) p.cwd = spec.cwd.c_str();
  p.die_with_parent = spec.die_with_parent;
  p.parent = ::getpid();
  return p;
}

void close_from(int lo, int hi) {
  if (lo > hi) return;
  if (::close_range(static_cast<unsigned>(lo), static_cast<unsigned>(hi), 0) == 0) return;
  int top = std::min(hi, 65535);
  for (int fd = lo; fd <= top; ++fd) ::close(fd);
}

// In the forked child: wire stdio, reset signals, exec. Reports errno on `errfd` on failure.
[[noreturn]] void exec_child(const Prepared& p, int in_fd, int out_fd, int err_fd, int errfd,
                             bool new_group) {
  if (new_group) ::setpgid(0, 0);
  if (p.die_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != p.parent) ::_exit(127);  // the parent died before prctl took effect
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig : {SIGPIPE, SIGINT, SIGQUIT, SIGTERM, SIGHUP, SIGCHLD}) ::signal(sig, SIG_DFL);
  int fds[3] = {in_fd, out_fd, err_fd};
  for (int i = 0; i < 3; ++i) {
    if (fds[i] == i) {
      ::fcntl(i, F_SETFD, 0);  // keep across exec
    } else if (::dup2(fds[i], i) < 0) {
      int e = errno;
      (void)!::write(errfd, &e, sizeof e);
      ::_exit(127);
    }
  }
  // Groups, then the group, then the user: after setuid the others could not be set.
  if (p.switch_user && (::setgroups(p.groups.size(), p.groups.data()) != 0 ||
                        ::setgid(p.gid) != 0 || ::setuid(p.uid) != 0)) {
    int e = errno;
    (void)!::write(errfd, &e, sizeof e);
    ::_exit(127);
  }
  if (p.cwd && ::chdir(p.cwd) != 0) {
    int e = errno;
    (void)!::write(errfd, &e, sizeof e);
    ::_exit(127);
  }
  close_from(3, errfd - 1);
  close_from(errfd + 1, ~0U >> 1);
  ::execvpe(p.program, p.argv.data(), p.envp.data());
  int e = errno;
  (void)!::write(errfd, &e, sizeof e);
  ::_exit(127);
}

// Reads the child's exec status from the close-on-exec error pipe: EOF means exec worked.
Status exec_status(int fd, const std::string& program, const std::string& cwd) {
  int e = 0;
  ssize_t n;
  do n = ::read(fd, &e, sizeof e);
  while (n < 0 && errno == EINTR);
  if (n <= 0) return {};
  if (e == ENOENT && !cwd.empty() && ::access(cwd.c_str(), F_OK) != 0)
    return make_error(
        Errc::not_found,
        fmt::format("cannot run '{}': working directory {} does not exist", program, cwd));
  if (e == ENOENT)
    return make_error(
        Errc::not_found,
        fmt::format("cannot run '{}': no such program (check PATH or install it)", program));
  return make_error(Errc::io, fmt::format("cannot run '{}': {}", program, std::strerror(e)));
}

Status check_spec(const ProcessSpec& spec) {
  if (spec.argv.empty() || spec.argv[0].empty())
    return make_error(Errc::internal, "run_process: empty argv");
  if (spec.run_as_uid >= 0 && spec.run_as_gid < 0)
    return make_error(Errc::internal, "run_process: run_as_uid without run_as_gid");
  if (spec.run_as_uid >= 0 && ::geteuid() != 0 &&
      static_cast<uid_t>(spec.run_as_uid) != ::geteuid())
    return make_error(Errc::precondition,
                      fmt::format("cannot run {} as uid {}: only root can switch users",
                                  spec.argv[0], spec.run_as_uid));
  return {};
}

int open_devnull(int flags) {
  return ::open("/dev/null", flags | O_CLOEXEC);
}

void set_nonblock(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

void decode_wait(int wstatus, int* exit_status, int* term_signal) {
  if (WIFEXITED(wstatus)) {
    *exit_status = WEXITSTATUS(wstatus);
    *term_signal = 0;
  } else if (WIFSIGNALED(wstatus)) {
    *exit_status = -1;
    *term_signal = WTERMSIG(wstatus);
  }
}

// Through syscall(): glibc 2.36's <sys/pidfd.h> lacks extern "C" for C++ callers.
int pidfd_for(pid_t pid) {
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

ProcessSpec shell_spec(std::string command, std::chrono::milliseconds timeout) {
  ProcessSpec s;
  s.argv = {"/bin/sh", "-c", std::move(command)};
  s.timeout = timeout;
  return s;
}

std::string signal_name(int sig) {
  if (const char* abbrev = ::sigabbrev_np(sig)) return fmt::format("SIG{}", abbrev);
  return fmt::format("signal {}", sig);
}

std::string ProcessResult::describe() const {
  std::string how =
      term_signal ? "killed by " + signal_name(term_signal) : fmt::format("exit {}", exit_status);
  if (timed_out) return fmt::format("timed out after {:.1f} s ({})", seconds, how);
  return how;
}

Result<ProcessResult> run_process(const ProcessSpec& spec) {
  SPARK_TRY(check_spec(spec));
  Prepared prep = prepare(spec);
  Pipe in, out, err, errp;
  SPARK_TRY(make_pipe(&out));
  SPARK_TRY(make_pipe(&err));
  SPARK_TRY(make_pipe(&errp));
  Fd devnull;
  if (!spec.input.empty()) {
    SPARK_TRY(make_pipe(&in));
  } else {
    devnull.reset(open_devnull(O_RDONLY));
  }
  int child_in = spec.input.empty() ? devnull.get() : in.read.get();

  auto t0 = Clock::now();
  pid_t pid = ::fork();
  if (pid < 0) return make_error(Errc::resource, fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0)
    exec_child(prep, child_in, out.write.get(), err.write.get(), errp.write.get(), true);
  // Also set the group from the parent, so a kill right after fork cannot miss the child.
  ::setpgid(pid, pid);
  in.read.reset();
  out.write.reset();
  err.write.reset();
  errp.write.reset();
  devnull.reset();
  if (Status st = exec_status(errp.read.get(), spec.argv[0], spec.cwd); !st.ok()) {
    int ws;
    ::waitpid(pid, &ws, 0);
    return st.error();
  }

  Fd pidfd(pidfd_for(pid));
  set_nonblock(out.read.get());
  set_nonblock(err.read.get());
  if (in.write.valid()) set_nonblock(in.write.get());

  // Writing to a child that closed stdin must give EPIPE, not kill us with SIGPIPE.
  sigset_t pipe_set, old_mask;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_set, &old_mask);
  bool got_epipe = false;

  ProcessResult r;
  size_t in_off = 0;
  bool reaped = false, term_sent = false, kill_sent = false;
  auto deadline = t0 + spec.timeout;
  Clock::time_point kill_at{}, give_up_at{};
  char buf[65536];

  auto drain = [&](Fd& fd, std::string& dst) {
    for (;;) {
      ssize_t n = ::read(fd.get(), buf, sizeof buf);
      if (n > 0) {
        size_t room = spec.output_limit > dst.size() ? spec.output_limit - dst.size() : 0;
        if (static_cast<size_t>(n) > room) r.truncated = true;
        dst.append(buf, std::min(room, static_cast<size_t>(n)));
        continue;
      }
      if (n == 0 || (errno != EINTR && errno != EAGAIN)) fd.reset();
      if (n < 0 && errno == EINTR) continue;
      return;
    }
  };
  auto try_reap = [&](int flags) {
    int ws = 0;
    pid_t w = ::waitpid(pid, &ws, flags);
    if (w == pid) {
      decode_wait(ws, &r.exit_status, &r.term_signal);
      reaped = true;
    } else if (w < 0 && errno == ECHILD) {
      reaped = true;  // someone else reaped it (SIGCHLD ignored): status unknown
    }
  };

  for (;;) {
    if (reaped && !out.read.valid() && !err.read.valid()) break;
    auto now = Clock::now();
    if (!term_sent && now >= deadline) {
      r.timed_out = true;
      term_sent = true;
      ::kill(-pid, SIGTERM);
      kill_at = now + spec.kill_grace;
    }
    if (term_sent && !kill_sent && now >= kill_at) {
      kill_sent = true;
      ::kill(-pid, SIGKILL);
      give_up_at = now + milliseconds(1000);
    }
    if (kill_sent && now >= give_up_at) {
      // Something that left our process group still holds the pipes: stop reading.
      out.read.reset();
      err.read.reset();
      if (!reaped) try_reap(0);
      break;
    }
    auto next = !term_sent ? deadline : !kill_sent ? kill_at : give_up_at;
    int wait_ms = static_cast<int>(std::clamp<int64_t>(
        std::chrono::duration_cast<milliseconds>(next - now).count() + 1, 0, 60000));
    if (!pidfd.valid() && !reaped) wait_ms = std::min(wait_ms, 10);

    pollfd pf[4];
    int n = 0, i_in = -1, i_out = -1, i_err = -1, i_pid = -1;
    if (in.write.valid()) pf[i_in = n++] = {in.write.get(), POLLOUT, 0};
    if (out.read.valid()) pf[i_out = n++] = {out.read.get(), POLLIN, 0};
    if (err.read.valid()) pf[i_err = n++] = {err.read.get(), POLLIN, 0};
    if (!reaped && pidfd.valid()) pf[i_pid = n++] = {pidfd.get(), POLLIN, 0};
    int rc = ::poll(pf, static_cast<nfds_t>(n), wait_ms);
    if (rc < 0 && errno != EINTR) break;
    if (rc > 0) {
      if (i_in >= 0 && pf[i_in].revents) {
        ssize_t w = ::write(in.write.get(), spec.input.data() + in_off, spec.input.size() - in_off);
        if (w > 0) in_off += static_cast<size_t>(w);
        if (w < 0 && errno == EPIPE) got_epipe = true;
        if ((w < 0 && errno != EAGAIN && errno != EINTR) || in_off == spec.input.size())
          in.write.reset();
      }
      if (i_out >= 0 && pf[i_out].revents) drain(out.read, r.out);
      if (i_err >= 0 && pf[i_err].revents) drain(err.read, r.err);
    }
    if (!reaped && (i_pid < 0 || (rc > 0 && pf[i_pid].revents))) try_reap(WNOHANG);
    // The child exited without reading all its input: stop offering it.
    if (reaped && in.write.valid()) in.write.reset();
  }
  if (!reaped) try_reap(0);

  if (got_epipe && !sigismember(&old_mask, SIGPIPE)) {
    timespec zero{};
    ::sigtimedwait(&pipe_set, nullptr, &zero);
  }
  ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  r.seconds = seconds_since(t0);
  return r;
}

Result<ProcessResult> run_shell(const std::string& command, std::chrono::milliseconds timeout,
                                const std::string& input) {
  ProcessSpec s = shell_spec(command, timeout);
  s.input = input;
  return run_process(s);
}

// ---- ChildProcess

namespace {
Result<int> open_log(const std::string& log_path) {
  int fd = log_path.empty()
               ? open_devnull(O_WRONLY)
               : ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
  if (fd < 0)
    return make_error(Errc::io,
                      fmt::format("cannot open log file {}: {}", log_path, std::strerror(errno)));
  return fd;
}
}  // namespace

Result<ChildProcess> ChildProcess::start(const ProcessSpec& spec, const std::string& log_path) {
  SPARK_TRY(check_spec(spec));
  auto logfd = open_log(log_path);
  if (!logfd) return logfd.error();
  Fd log(*logfd);
  Fd devnull(open_devnull(O_RDONLY));
  Pipe errp;
  SPARK_TRY(make_pipe(&errp));
  Prepared prep = prepare(spec);
  pid_t pid = ::fork();
  if (pid < 0) return make_error(Errc::resource, fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) exec_child(prep, devnull.get(), log.get(), log.get(), errp.write.get(), true);
  ::setpgid(pid, pid);
  errp.write.reset();
  if (Status st = exec_status(errp.read.get(), spec.argv[0], spec.cwd); !st.ok()) {
    int ws;
    ::waitpid(pid, &ws, 0);
    return st.error();
  }
  ChildProcess c;
  c.pid_ = pid;
  c.pidfd_ = pidfd_for(pid);
  if (c.pidfd_ >= 0) ::fcntl(c.pidfd_, F_SETFD, FD_CLOEXEC);
  return c;
}

ChildProcess::ChildProcess(ChildProcess&& o) noexcept {
  *this = std::move(o);
}

ChildProcess& ChildProcess::operator=(ChildProcess&& o) noexcept {
  if (this != &o) {
    stop();
    pid_ = std::exchange(o.pid_, 0);
    pidfd_ = std::exchange(o.pidfd_, -1);
    exit_status_ = o.exit_status_;
    term_signal_ = o.term_signal_;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  stop();
}

void ChildProcess::reaped(int wstatus) {
  decode_wait(wstatus, &exit_status_, &term_signal_);
  pid_ = 0;
  if (pidfd_ >= 0) ::close(pidfd_);
  pidfd_ = -1;
}

bool ChildProcess::running() {
  if (pid_ == 0) return false;
  int ws = 0;
  pid_t w = ::waitpid(pid_, &ws, WNOHANG);
  if (w == pid_) {
    reaped(ws);
    return false;
  }
  if (w < 0 && errno == ECHILD) {
    reaped(0);
    return false;
  }
  return true;
}

bool ChildProcess::wait(std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (running()) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    if (pidfd_ >= 0) {
      pollfd pf{pidfd_, POLLIN, 0};
      ::poll(&pf, 1, static_cast<int>(std::min<int64_t>(left, 60000)));
    } else {
      ::usleep(static_cast<useconds_t>(std::min<int64_t>(left, 10) * 1000));
    }
  }
  return true;
}

void ChildProcess::stop(std::chrono::milliseconds grace) {
  if (!running()) return;
  pid_t group = pid_;
  ::kill(-group, SIGTERM);
  if (!wait(grace)) {
    ::kill(-group, SIGKILL);
    int ws = 0;
    if (::waitpid(pid_, &ws, 0) == pid_)
      reaped(ws);
    else
      reaped(0);
  }
  // Members of the group that outlived its leader go too.
  ::kill(-group, SIGKILL);
}

// ---- spawn_detached

Result<pid_t> spawn_detached(const ProcessSpec& spec, const std::string& log_path) {
  SPARK_TRY(check_spec(spec));
  auto logfd = open_log(log_path);
  if (!logfd) return logfd.error();
  Fd log(*logfd);
  Fd devnull(open_devnull(O_RDONLY));
  Pipe errp, pidp;
  SPARK_TRY(make_pipe(&errp));
  SPARK_TRY(make_pipe(&pidp));
  Prepared prep = prepare(spec);
  prep.die_with_parent = false;  // its parent exits at once by design
  pid_t first = ::fork();
  if (first < 0) return make_error(Errc::resource, fmt::format("fork: {}", std::strerror(errno)));
  if (first == 0) {
    ::setsid();
    pid_t second = ::fork();
    if (second == 0) {
      // The daemon leads a session of its own (and so its own process group): a session that
      // ends, or a kill of the caller's group, never reaches it, and `ps -o sid` shows it.
      ::setsid();
      exec_child(prep, devnull.get(), log.get(), log.get(), errp.write.get(), false);
    }
    if (second < 0) {
      int e = errno;
      (void)!::write(errp.write.get(), &e, sizeof e);
      ::_exit(1);
    }
    (void)!::write(pidp.write.get(), &second, sizeof second);
    ::_exit(0);
  }
  errp.write.reset();
  pidp.write.reset();
  int ws;
  while (::waitpid(first, &ws, 0) < 0 && errno == EINTR) {
  }
  pid_t daemon_pid = 0;
  ssize_t n;
  do n = ::read(pidp.read.get(), &daemon_pid, sizeof daemon_pid);
  while (n < 0 && errno == EINTR);
  SPARK_TRY(exec_status(errp.read.get(), spec.argv[0], spec.cwd));
  if (n != static_cast<ssize_t>(sizeof daemon_pid) || daemon_pid <= 0)
    return make_error(Errc::internal,
                      fmt::format("spawn_detached '{}': lost the daemon's pid", spec.argv[0]));
  return daemon_pid;
}

// ---- quoting

std::string shell_quote(std::string_view word) {
  if (!word.empty() && word.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                              "0123456789_-+=./:,@%") == std::string_view::npos)
    return std::string(word);
  std::string q = "'";
  for (char c : word) {
    if (c == '\'')
      q += "'\\''";
    else
      q += c;
  }
  q += "'";
  return q;
}

std::string shell_join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) {
    if (!s.empty()) s += ' ';
    s += shell_quote(a);
  }
  return s;
}

void init_spawn_attr_own_group(posix_spawnattr_t* attr) {
  posix_spawnattr_init(attr);
  posix_spawnattr_setflags(attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(attr, 0);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(attr, &none);
  posix_spawnattr_setsigdefault(attr, &all);
}

}  // namespace spark
