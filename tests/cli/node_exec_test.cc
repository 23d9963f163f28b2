// The one way the CLI runs something on nodes (cli/node_exec.h over core/remote's fan_out):
// per-node commands and stdin, a non-zero exit that is not an error, a deadline that is.
// Local nodes run real /bin/sh processes; the SSH path is covered by tests/e2e/ssh_test.cc.
#include "cli/node_exec.h"

#include <doctest/doctest.h>

#include <string>

#include "core/remote.h"

using namespace spark;
using namespace spark::cli;
using namespace std::chrono_literals;

namespace {
RingConfig three_local_nodes() {
  auto cfg = load_config_text(
      "NODE0_SSH=local\nNODE1_SSH=local\nNODE2_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\n"
      "NODE1_FABRIC_IP=127.0.0.2\nNODE2_FABRIC_IP=127.0.0.3\n",
      "ring.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  return *cfg;
}
}  // namespace

TEST_CASE("fan_out: each runner gets its own stdin, or all the same one") {
  auto a = make_local_runner("a"), b = make_local_runner("b");
  auto per = fan_out({a.get(), b.get()}, {"cat"}, 10s, {"to a", "to b"});
  REQUIRE(per.size() == 2);
  REQUIRE(per[0].result.ok());
  REQUIRE(per[1].result.ok());
  CHECK(per[0].result->out == "to a");
  CHECK(per[1].result->out == "to b");
  auto same = fan_out({a.get(), b.get()}, {"cat"}, 10s, {"all"});
  CHECK(same[1].result->out == "all");
  auto wrong = fan_out({a.get(), b.get()}, {"cat"}, 10s, {"1", "2", "3"});
  CHECK_FALSE(wrong[0].result.ok());
}

TEST_CASE("run_on_nodes: one result per job, in order, named; exits are not errors") {
  auto cfg = three_local_nodes();
  auto runs = run_on_nodes(cfg,
                           {{2, "read x; echo \"node 2 got $x\"", "secret\n"},
                            {0, "echo out; echo err >&2; exit 3", ""},
                            {1, "cat", "one\ntwo\n"}},
                           10s);
  REQUIRE(runs.size() == 3);
  CHECK(runs[0].index == 2);
  CHECK(runs[0].node == cfg.nodes[2].name);
  CHECK(runs[0].ok());
  CHECK(runs[0].out == "node 2 got secret\n");
  CHECK(runs[1].ok());  // a non-zero exit is the command's answer, not a failure to run it
  CHECK(runs[1].exit_status == 3);
  CHECK(runs[1].out == "out\n");
  CHECK(runs[1].err == "err\n");
  CHECK(runs[2].out == "one\ntwo\n");
}

TEST_CASE("run_on_nodes: a job past its deadline is a timeout error naming node and command") {
  auto cfg = three_local_nodes();
  auto runs = run_on_nodes(cfg, jobs_on({0, 1}, {"echo started; sleep 30", "echo quick"}), 1500ms);
  REQUIRE(runs.size() == 2);
  REQUIRE_FALSE(runs[0].ok());
  CHECK(runs[0].error->code == Errc::timeout);
  CHECK(runs[0].error->message.find(cfg.nodes[0].name) != std::string::npos);
  CHECK(runs[0].error->message.find("sleep 30") != std::string::npos);
  CHECK(runs[1].ok());  // the other node is not held up by the slow one
  CHECK(runs[1].out == "quick\n");
}
