// The readiness probe: a real completion through the engine, and the RDMA counters of a
// fixture sysfs tree that the test moves (or not) during the probe.
#include "daemon/probe.h"

#include <doctest/doctest.h>

#include "daemon/backend.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {
// Test double for fault injection: answers the probe with a given text, and can bump the
// fixture RDMA counters while "generating", as real fabric traffic would.
class ProbeBackendDouble final : public Backend {
 public:
  std::string text = " Paris.";
  Errc fail = Errc::ok;
  std::function<void()> during;
  const char* name() const override { return "probe-double"; }
  Status start(BackendContext&) override { return Status::Ok(); }
  BackendStatus status() override { return {}; }
  void stop(std::chrono::milliseconds) override {}
  Result<std::string> probe(const std::string& prompt, std::chrono::milliseconds) override {
    if (prompt.empty()) return make_error(Errc::usage, "empty prompt");
    if (during) during();
    if (fail != Errc::ok) return make_error(fail, "injected");
    return text;
  }
};

void set_counters(const test::TempDir& root, const std::string& hca, uint64_t tx, uint64_t rx) {
  root.write("sys/class/infiniband/" + hca + "/ports/1/counters/port_xmit_data",
             std::to_string(tx) + "\n");
  root.write("sys/class/infiniband/" + hca + "/ports/1/counters/port_rcv_data",
             std::to_string(rx) + "\n");
}
}  // namespace

TEST_CASE("probe: the completion must come back and contain PROBE_EXPECT") {
  ProbeBackendDouble e;
  ProbeSpec spec;
  spec.expect = "Paris";
  CHECK(run_probe(e, spec).status == "passed");
  CHECK(run_probe(e, spec).text == " Paris.");
  e.text = " London.";
  auto r = run_probe(e, spec);
  CHECK(r.status == "failed");
  CHECK(r.reason.find("PROBE_EXPECT 'Paris'") != std::string::npos);
  e.text = "  ";
  spec.expect.clear();
  CHECK(run_probe(e, spec).status == "failed");
  e.fail = Errc::timeout;
  CHECK(run_probe(e, spec).status == "failed");
  e.fail = Errc::unsupported;
  r = run_probe(e, spec);
  CHECK(r.status == "skipped");
}

TEST_CASE("probe: on an RDMA fabric the HCA counters must move during the probe") {
  test::TempDir root("probe-sysfs");
  set_counters(root, "rocep1s0f0", 1000, 2000);
  set_counters(root, "rocep1s0f1", 10, 20);
  auto c = read_rdma_counters(root.path(), {"rocep1s0f0", "rocep1s0f1"});
  REQUIRE(c.has_value());
  CHECK(*c == 3030);
  CHECK_FALSE(read_rdma_counters(root.path(), {"mlx5_9"}).has_value());

  ProbeBackendDouble e;
  ProbeSpec spec;
  spec.root = root.path();
  spec.hcas = {"rocep1s0f0", "rocep1s0f1"};
  spec.check_rdma = true;
  auto r = run_probe(e, spec);  // nothing moved: a socket fallback
  CHECK(r.status == "failed");
  CHECK(r.reason.find("did not move") != std::string::npos);
  e.during = [&] { set_counters(root, "rocep1s0f1", 5010, 20); };
  r = run_probe(e, spec);
  CHECK(r.status == "passed");
  CHECK(r.rdma_checked);
  CHECK(r.rdma_bytes == 5000);
  CHECK(to_json(r)["rdma"]["bytes"] == 20000);
}

TEST_CASE("probe: spec from the cluster file") {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text(
      "NODE0_SSH=local\nNODE0_GPUS=0,1\nNODE0_HCAS=rocep1s0f0\nPROBE_EXPECT=Paris\n", "t.env", env,
      &d);
  REQUIRE(cfg.ok());
  ProbeSpec s = probe_spec(*cfg);
  CHECK(s.prompt == "The capital of France is");
  CHECK(s.expect == "Paris");
  CHECK(s.check_rdma);
  CHECK(s.hcas == std::vector<std::string>{"rocep1s0f0"});
}
