// Engine pinning and rollback end to end: a 2-rank ring in network namespaces behind real
// sshd (tests/support/netns_ring.h) whose engine runs through the fault-injection container
// runtime (tests/support/fault_docker/docker: images by tag and digest, a broken one fails
// to start). start records the image digest on every node and, at READY, the last good
// set; the tag moves to a broken image and a restart fails; rollback starts the image by
// its digest and the ring is READY again; status shows the current and last good sets.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/process.h"
#include "core/strings.h"
#include "support/netns_ring.h"
#include "support/ring.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;
using test::NetnsRing;
namespace fs = std::filesystem;

namespace {
const std::string kGood = "sha256:" + std::string(64, 'a');
const std::string kBroken = "sha256:" + std::string(64, 'b');
}  // namespace

TEST_CASE("e2e netns rollback: a broken nightly image, then rollback to the last good digest") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    std::printf("SKIP: %s\n", why.c_str());
    return;
  }
  test::TempDir fd("spark-fault-docker");
  fd.write("tags/spark_engine_nightly", kGood + "\n");
  fd.write("broken", kBroken + "\n");
  std::string docker = fd.write(
      "bin/docker",
      fmt::format(
          "#!/bin/sh\nFAULT_DOCKER_DIR={} exec {}/tests/support/fault_docker/docker \"$@\"\n",
          fd.path(), SPARK_SOURCE_DIR));
  REQUIRE(::chmod(docker.c_str(), 0755) == 0);
  auto made = NetnsRing::create(
      {.ranks = 2,
       .sparkctl_bin = SPARKCTL_BIN,
       .sparkd_bin = SPARKD_BIN,
       .fault_server_bin = FAULT_SERVER_BIN,
       .extra_config = {fmt::format(
           "ENGINE_EXEC='exec {} run --rm --network host spark/engine:nightly {} --port {} "
           "--mode healthy --watch-pid $SPARKD_PID'",
           docker, FAULT_SERVER_BIN, NetnsRing::kEnginePort)}});
  REQUIRE_MESSAGE(made.ok(), (made.ok() ? "" : made.error().message));
  auto& ring = **made;
  auto s = ring.ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  auto st = ring.ctl_json({"status"});
  const auto& good = st.j["engine_sets"]["last_good"];
  REQUIRE_MESSAGE(good.is_object(), st.all());
  CHECK(good["ready"] == true);
  REQUIRE(good["nodes"].size() == 2);
  for (const auto& n : good["nodes"]) {
    CHECK(n["image"]["id"] == kGood);
    CHECK(n["image"]["ref"] == "spark/engine:nightly");
    CHECK(n["image"]["runtime"] == "docker");
  }
  CHECK(good.contains("config_text") == false);  // not in status output
  auto table = ring.ctl({"status"});
  CHECK(table.out.find("last good image spark/engine:nightly sha256:aaaa") != std::string::npos);

  // The nightly tag moves to a broken build: a restart fails and the last good set stays.
  fd.write("tags/spark_engine_nightly", kBroken + "\n");
  auto bad = ring.ctl_json({"restart"});
  REQUIRE_MESSAGE(bad.rc != 0, bad.all());
  st = ring.ctl_json({"status"});
  CHECK(st.j["engine_sets"]["current"]["nodes"][0]["image"]["id"] == kBroken);
  CHECK(st.j["engine_sets"]["current"]["ready"] == false);
  CHECK(st.j["engine_sets"]["last_good"]["nodes"][0]["image"]["id"] == kGood);

  auto rb = ring.ctl_json({"rollback"});
  REQUIRE_MESSAGE(rb.rc == 0, rb.all(), ring.logs());
  CHECK(rb.j["ready"] == true);
  CHECK(rb.j["rolled_back_to"]["engine_exec"].get<std::string>().find("spark/engine@" + kGood) !=
        std::string::npos);
  // Every rank's engine was started by digest, not by the moved tag.
  auto calls = read_file(fd / "calls").value_or("");
  CHECK(calls.find("run --rm --network host spark/engine@" + kGood) != std::string::npos);
  st = ring.ctl_json({"status"});
  CHECK(st.rc == 0);
  CHECK(st.j["engine_sets"]["current"]["ready"] == true);
  CHECK(st.j["engine_sets"]["current"]["nodes"][1]["image"]["id"] == kGood);
  // The bundle names what runs (start's record: the good digest) and what the cluster
  // file's tag points at now (the broken one), the same on both nodes.
  auto b = ring.ctl_json({"bundle", "--out", fd / "b.tar.gz"}, 240s);
  REQUIRE_MESSAGE(b.rc == 0, b.all());
  bool tag_now = false;
  for (const auto& d : b.j["diff"])
    if (d["field"] == "engine_image")
      tag_now = d["differs"] == false &&
                d["values"][0].get<std::string>() == "spark/engine:nightly " + kBroken;
  CHECK_MESSAGE(tag_now, b.j["diff"].dump());
  REQUIRE(fs::create_directories(fd / "x"));
  ProcessSpec untar;
  untar.argv = {"tar", "-xzf", fd / "b.tar.gz", "-C", fd / "x"};
  REQUIRE(run_process(untar).ok());
  std::string summary;
  for (const auto& e : fs::directory_iterator(fd / "x"))
    summary = read_file(e.path().string() + "/SUMMARY.txt").value_or("");
  CHECK_MESSAGE(
      summary.find("engine started last: image spark/engine@" + kGood) != std::string::npos,
      summary);
  (void)ring.ctl({"stop"});
}

TEST_CASE("e2e rollback: nothing to roll back to is an error naming the file") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto made = NetnsRing::create({.ranks = 2,
                                 .sparkctl_bin = SPARKCTL_BIN,
                                 .sparkd_bin = SPARKD_BIN,
                                 .fault_server_bin = FAULT_SERVER_BIN});
  REQUIRE(made.ok());
  auto r = (*made)->ctl({"rollback"});
  CHECK(r.rc == exit_code(Errc::not_found));
  CHECK(r.err.find("engine/last-good.json") != std::string::npos);
}
