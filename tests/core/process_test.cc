#include "core/process.h"

#include <doctest/doctest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <thread>

#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;

namespace {

// True when `pid` no longer runs: gone from /proc, or a zombie nobody reaped yet.
bool process_gone(pid_t pid) {
  auto stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  auto close_paren = stat->rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < stat->size() &&
         (*stat)[close_paren + 2] == 'Z';
}

bool gone_within(pid_t pid, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!process_gone(pid)) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

std::string proc_stat_field(pid_t pid, int field) {  // field numbering as in proc(5), >= 3
  auto stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return {};
  auto rest = stat->substr(stat->rfind(')') + 2);
  auto parts = split_list(rest, ' ');
  size_t i = static_cast<size_t>(field - 3);
  return i < parts.size() ? parts[i] : std::string{};
}

}  // namespace

TEST_CASE("run_process reports exit codes and signals") {
  auto r = run_shell("echo out; echo err >&2; exit 3", 10s);
  REQUIRE(r.ok());
  CHECK(r->exit_status == 3);
  CHECK(r->term_signal == 0);
  CHECK(r->out == "out\n");
  CHECK(r->err == "err\n");
  CHECK_FALSE(r->success());
  CHECK(r->describe() == "exit 3");

  auto k = run_shell("kill -9 $$", 10s);
  REQUIRE(k.ok());
  CHECK(k->exit_status == -1);
  CHECK(k->term_signal == SIGKILL);
  CHECK(k->describe() == "killed by SIGKILL");

  auto ok = run_shell("true", 10s);
  REQUIRE(ok.ok());
  CHECK(ok->success());
}

TEST_CASE("run_process runs argv without a shell, searching PATH") {
  ProcessSpec s;
  s.argv = {"printf", "%s|", "a b", "$HOME", "c"};
  auto r = run_process(s);
  REQUIRE(r.ok());
  CHECK(r->out == "a b|$HOME|c|");
}

TEST_CASE("a missing program or working directory is a clear error") {
  ProcessSpec s;
  s.argv = {"no-such-program-spark-xyz"};
  auto r = run_process(s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::not_found);
  CHECK(r.error().message.find("no-such-program-spark-xyz") != std::string::npos);

  ProcessSpec c = shell_spec("true");
  c.cwd = "/nonexistent/spark-dir";
  auto rc = run_process(c);
  REQUIRE_FALSE(rc.ok());
  CHECK(rc.error().message.find("/nonexistent/spark-dir") != std::string::npos);
}

TEST_CASE("run_process passes environment and working directory") {
  test::TempDir dir;
  ProcessSpec s = shell_spec("echo \"$SPARK_T1:$HOME_SET\"; pwd");
  s.env = {{"SPARK_T1", "one two"}, {"HOME_SET", "x"}};
  s.cwd = dir.path();
  auto r = run_process(s);
  REQUIRE(r.ok());
  CHECK(r->out == "one two:x\n" + dir.path() + "\n");
}

TEST_CASE("stdin round-trips, and a child that ignores stdin does not kill us") {
  std::string input;
  for (int i = 0; i < 300000; ++i) input += std::to_string(i) + "\n";  // ~2 MiB
  auto r = run_shell("cat", 30s, input);
  REQUIRE(r.ok());
  CHECK(r->exit_status == 0);
  CHECK(r->out.size() == input.size());
  CHECK(r->out == input);

  // The child exits without reading: writing to it gives EPIPE, never SIGPIPE.
  auto t = run_shell("exit 0", 10s, std::string(4 << 20, 'x'));
  REQUIRE(t.ok());
  CHECK(t->exit_status == 0);

  // Empty input is /dev/null: a reader sees EOF at once instead of hanging.
  auto e = run_shell("cat; echo done", 10s);
  REQUIRE(e.ok());
  CHECK(e->out == "done\n");
}

TEST_CASE("large output on both streams does not deadlock") {
  // stderr first: a reader that drained stdout to EOF before stderr would hang here.
  auto r = run_shell(
      "head -c 3000000 /dev/zero | tr '\\0' e >&2; head -c 2500000 /dev/zero | tr '\\0' o; "
      "head -c 1500000 /dev/zero | tr '\\0' E >&2",
      30s);
  REQUIRE(r.ok());
  CHECK(r->exit_status == 0);
  CHECK(r->out.size() == 2500000);
  CHECK(r->err.size() == 4500000);
  CHECK(r->out.find_first_not_of('o') == std::string::npos);
  CHECK_FALSE(r->truncated);
}

TEST_CASE("output beyond the limit is dropped and flagged") {
  ProcessSpec s = shell_spec("head -c 100000 /dev/zero");
  s.output_limit = 1000;
  auto r = run_process(s);
  REQUIRE(r.ok());
  CHECK(r->exit_status == 0);
  CHECK(r->out.size() == 1000);
  CHECK(r->truncated);
}

TEST_CASE("a timeout kills the whole process group within the deadline") {
  test::TempDir dir;
  std::string pids = dir / "pids";
  // A background child and a foreground one; both must die.
  ProcessSpec s = shell_spec(
      "sleep 100 & echo $! > " + pids + "; sleep 100 & echo $! >> " + pids + "; wait", 500ms);
  s.kill_grace = 500ms;
  auto r = run_process(s);
  REQUIRE(r.ok());
  // The deadline ended it (not the 100 s sleeps), with the TERM (not the KILL after the grace).
  CHECK(r->timed_out);
  CHECK_FALSE(r->success());
  CHECK(r->term_signal == SIGTERM);
  CHECK(r->describe().find("timed out") == 0);
  auto text = read_file(pids);
  REQUIRE(text);
  auto list = split_list(*text, '\n');
  REQUIRE(list.size() == 2);
  for (const auto& p : list) {
    INFO("child pid " << p);
    CHECK(gone_within(std::stoi(p), 2s));
  }
}

TEST_CASE("a child that ignores SIGTERM is killed after the grace period") {
  ProcessSpec s = shell_spec("trap '' TERM; sleep 100 & trap '' TERM; wait; wait", 300ms);
  s.kill_grace = 300ms;
  auto r = run_process(s);
  REQUIRE(r.ok());
  CHECK(r->timed_out);
  CHECK(r->term_signal == SIGKILL);  // the KILL after the grace ended it, not the sleep
}

TEST_CASE("ChildProcess runs in the background, logs, and stops its group") {
  test::TempDir dir;
  auto c = ChildProcess::start(shell_spec("echo hello; exit 7"), dir / "log");
  REQUIRE(c.ok());
  CHECK(c->wait(10s));
  CHECK(c->exit_status() == 7);
  CHECK(read_file(dir / "log").value_or("") == "hello\n");

  std::string pidfile = dir / "grandchild";
  auto s = ChildProcess::start(shell_spec("sleep 100 & echo $! > " + pidfile + "; wait"), {});
  REQUIRE(s.ok());
  CHECK(s->running());
  for (int i = 0; i < 500 && !read_file(pidfile).value_or("").ends_with("\n"); ++i)
    std::this_thread::sleep_for(10ms);
  pid_t grandchild = std::stoi(read_file(pidfile).value_or("0"));
  REQUIRE(grandchild > 0);
  CHECK_FALSE(s->wait(100ms));
  s->stop(1s);
  CHECK_FALSE(s->running());
  CHECK(s->term_signal() == SIGTERM);  // the TERM stopped it: no wait for the grace
  CHECK(gone_within(grandchild, 2s));
}

TEST_CASE("die_with_parent ends the child when the thread that started it exits") {
  pid_t pid = 0;
  std::thread starter([&] {
    ProcessSpec s = shell_spec("exec sleep 100");
    s.die_with_parent = true;
    auto c = ChildProcess::start(s, {});
    REQUIRE(c.ok());
    pid = c->pid();
    // Keep the ChildProcess from stopping it when this thread ends, as if the test crashed.
    static std::optional<ChildProcess> kept;
    kept.emplace(std::move(*c));
  });
  starter.join();
  REQUIRE(pid > 0);
  CHECK(gone_within(pid, 2s));
  ::kill(pid, SIGKILL);  // only matters when the check failed
  int ws;
  ::waitpid(pid, &ws, 0);
}

TEST_CASE("spawn_detached starts a daemon in its own session that outlives the call") {
  test::TempDir dir;
  std::string pidfile = dir / "pid";
  ProcessSpec s = shell_spec("echo $$ > " + pidfile + "; echo started; echo oops >&2; sleep 100");
  auto pid = spawn_detached(s, dir / "daemon.log");
  REQUIRE(pid.ok());
  for (int i = 0; i < 500 && !read_file(pidfile).value_or("").ends_with("\n"); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(std::stoi(read_file(pidfile).value_or("0")) == *pid);
  CHECK_FALSE(process_gone(*pid));
  CHECK(proc_stat_field(*pid, 4) != std::to_string(::getpid()));  // not our child
  CHECK(::getsid(*pid) == *pid);                                  // leads its own session
  CHECK(::getpgid(*pid) == *pid);                                 // own group
  CHECK(proc_stat_field(*pid, 7) == "0");                         // no controlling tty
  for (int i = 0; i < 500 && read_file(dir / "daemon.log").value_or("").size() < 13; ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(read_file(dir / "daemon.log").value_or("") == "started\noops\n");
  ::kill(-*pid, SIGKILL);
  CHECK(gone_within(*pid, 2s));

  ProcessSpec bad;
  bad.argv = {"no-such-daemon-spark-xyz"};
  auto b = spawn_detached(bad, dir / "bad.log");
  REQUIRE_FALSE(b.ok());
  CHECK(b.error().code == Errc::not_found);
}

TEST_CASE("run_as: the child runs as the given user, with its groups and home") {
  ProcessSpec s = shell_spec("id -u; id -g; id -G; echo \"$HOME $USER $KEEP\"");
  s.run_as_uid = 65534;
  s.run_as_gid = 65534;
  s.env["KEEP"] = "kept";
  if (::geteuid() != 0) {
    auto r = run_process(s);
    REQUIRE_FALSE(r.ok());  // only root may switch to another user
    CHECK(r.error().code == Errc::precondition);
    CHECK(r.error().message.find("only root") != std::string::npos);
    MESSAGE("SKIP: the switch itself needs root");
    return;
  }
  auto r = run_process(s);
  REQUIRE(r.ok());
  REQUIRE(r->exit_status == 0);
  auto lines = split_list(r->out, '\n');
  REQUIRE(lines.size() >= 4);
  CHECK(lines[0] == "65534");
  CHECK(lines[1] == "65534");
  CHECK(lines[2].find(" 0") == std::string::npos);  // root's groups are gone
  CHECK(lines[2] != "0");
  if (::getpwuid(65534) != nullptr) {  // nobody's home and name from the user database
    CHECK(lines[3].find(::getpwuid(65534)->pw_dir) == 0);
    CHECK(lines[3].find(::getpwuid(65534)->pw_name) != std::string::npos);
  }
  CHECK(lines[3].ends_with(" kept"));

  // Detached, as sparkd is started: the daemon and its log.
  test::TempDir dir;
  ProcessSpec d = shell_spec("id -u; sleep 100");
  d.run_as_uid = 65534;
  d.run_as_gid = 65534;
  auto pid = spawn_detached(d, dir / "daemon.log");
  REQUIRE(pid.ok());
  for (int i = 0; i < 500 && read_file(dir / "daemon.log").value_or("").empty(); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(read_file(dir / "daemon.log").value_or("") == "65534\n");
  CHECK(read_file("/proc/" + std::to_string(*pid) + "/status")
            .value_or("")
            .find("Uid:\t65534\t65534\t65534\t65534") != std::string::npos);
  ::kill(-*pid, SIGKILL);
  CHECK(gone_within(*pid, 2s));

  ProcessSpec half = shell_spec("true");
  half.run_as_uid = 65534;  // no group: refused, not run as root's group
  auto h = run_process(half);
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().code == Errc::internal);
}

TEST_CASE("shell_quote survives the shell") {
  for (std::string w : {"plain", "", "it's", "a b\tc", "$HOME `id` \"q\" \\ ;|&*?", "-n"}) {
    auto r = run_shell("printf '%s' " + shell_quote(w), 10s);
    REQUIRE(r.ok());
    CHECK(r->out == w);
  }
  CHECK(shell_join({"echo", "a b", "c"}) == "echo 'a b' c");
  CHECK(signal_name(SIGTERM) == "SIGTERM");
}
