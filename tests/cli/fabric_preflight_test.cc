// `sparkctl preflight --fabric` orchestration with the real sparkd fabric-rank on a local
// one-node ring: the rank's environment rendered as `sparkctl env` does, the node side run,
// its JSON read back. Without a GPU the rank must fail with the reason (not hang, not
// crash); with one it must pass (tests/hw and scripts/nccl-ring.sh check the figures).
#include "cli/fabric_preflight.h"

#include <doctest/doctest.h>

#include "core/strings.h"
#include "support/gpu.h"
#include "support/tempdir.h"

using namespace spark;

TEST_CASE("preflight --fabric: one local rank through sparkd fabric-rank, report or reason") {
  test::TempDir dir;
  const std::string text =
      "RING_NAME=fabric-t\nNODE0_NAME=here\nNODE0_SSH=local\n"
      "NODE0_FABRIC_IP=127.0.0.1\nRDZV_PORT=29779\nSTATE_DIR=" +
      dir.path() + "/state\nSPARKD_BIN=" SPARK_BINARY_DIR "/daemon/sparkd\n";
  auto cfg = load_config_text(text, "fabric.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? std::string() : cfg.error().message));
  cli::PreflightRun run;
  run.sparkctl_bin = SPARK_BINARY_DIR "/cli/sparkctl";
  run.timeout = std::chrono::seconds(60);
  auto f = cli::run_fabric_preflight(*cfg, run);
  auto j = cli::fabric_preflight_to_json(f);
  std::string table = cli::render_fabric_preflight(f);
  if (!test::cuda_skip_reason().empty()) {
    REQUIRE(f.errors.size() == 1);
    CHECK(f.errors[0].find("rank 0 (here)") == 0);
    CHECK(f.errors[0].find("the fabric self-test needs this rank's GPU") != std::string::npos);
    CHECK_FALSE(f.passed());
    CHECK(j["passed"] == false);
    CHECK(table.find("# fabric FAILED") != std::string::npos);
    return;
  }
  REQUIRE_MESSAGE(f.errors.empty(), join(f.errors, "; "));
  REQUIRE(f.ranks.size() == 1);
  CHECK(f.passed());
  CHECK(f.ranks[0].points.size() == 32);
  CHECK(table.find("# fabric PASSED") != std::string::npos);
}
