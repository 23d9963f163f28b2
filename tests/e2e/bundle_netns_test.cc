// sparkctl bundle end to end: a 2-rank ring in network namespaces behind real sshd
// (tests/support/netns_ring.h), started, then bundled from the head: every node's capture,
// versions, preflight report and log tails arrive, SUMMARY.txt leads the archive with the
// diff, and secrets planted in the cluster file, the API key file and a sparkd log are
// nowhere in the archive (nor in the nested captures). Then one node is made unreachable:
// it is named, and the other is bundled.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
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

// A command line with the default deadline.
Result<ProcessResult> run(std::vector<std::string> argv) {
  ProcessSpec ps;
  ps.argv = std::move(argv);
  return run_process(ps);
}

const char* kPlantedKey = "sk-plantedapikey0123456789abcdef";
const char* kPlantedToken = "hf_plantedhftoken0123456789abcd";
const char* kPlantedBearer = "plantedbearer-55aa55aa55";
const char* kPlantedLog = "plantedlogpassword-9911";

// Every file under `dir`, nested .tar.gz archives unpacked beside themselves, as one text.
std::string everything_under(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file() && ends_with(e.path().string(), ".tar.gz")) {
      std::string into = e.path().string() + ".d";
      fs::create_directories(into);
      auto r = run({"tar", "-xzf", e.path().string(), "-C", into});
      REQUIRE_MESSAGE((r && r->success()), "cannot unpack ", e.path().string());
    }
  std::string all;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file() && !ends_with(e.path().string(), ".tar.gz"))
      all += read_file(e.path().string()).value_or("") + "\n";
  return all;
}

}  // namespace

TEST_CASE("e2e netns bundle: every node bundled with redaction; a node down is named") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    std::printf("SKIP: %s\n", why.c_str());
    return;
  }
  test::TempDir keys("spark-bundle-key");
  auto key = keys.write("api.key", std::string(kPlantedKey) + "\n");
  REQUIRE(::chmod(key.c_str(), 0600) == 0);
  auto made = NetnsRing::create(
      {.ranks = 2,
       .sparkctl_bin = SPARKCTL_BIN,
       .sparkd_bin = SPARKD_BIN,
       .fault_server_bin = FAULT_SERVER_BIN,
       .extra_config = {fmt::format("WATCH_ALERT_CMD='HF_TOKEN={} curl -H \"Authorization: Bearer "
                                    "{}\" https://hooks.example.com/x'",
                                    kPlantedToken, kPlantedBearer)}});
  REQUIRE_MESSAGE(made.ok(), (made.ok() ? "" : made.error().message));
  auto& ring = **made;
  auto s = ring.ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  // Secrets that reach a log: the API key by value, a password by name.
  {
    std::ofstream log(ring.state("logs/sparkd-1.log"), std::ios::app);
    log << "debug: client sent " << kPlantedKey << "; password=" << kPlantedLog << "\n";
  }
  // The API key file is named for the bundle only (the ring runs without one).
  ring.env["API_KEY_FILE"] = key;

  test::TempDir out("spark-bundle-out");
  auto b = ring.ctl_json({"bundle", "--out", out / "b.tar.gz"}, 240s);
  REQUIRE_MESSAGE(b.rc == 0, b.all());
  CHECK(b.j["nodes"] == json::array({"node0", "node1"}));
  CHECK(b.j["missing"].empty());
  auto list = run({"tar", "-tzf", out / "b.tar.gz"});
  REQUIRE(list);
  auto members = split_list(list->out, '\n');
  REQUIRE(!members.empty());
  CHECK(ends_with(members[0], "/SUMMARY.txt"));  // the diff leads the archive
  REQUIRE(fs::create_directories(out / "x"));
  auto x = run({"tar", "-xzf", out / "b.tar.gz", "-C", out / "x"});
  REQUIRE((x && x->success()));
  std::string top;
  for (const auto& e : fs::directory_iterator(out / "x")) top = e.path().string();
  REQUIRE(starts_with(fs::path(top).filename().string(), "sparkctl-bundle-nsring-"));
  auto summary = read_file(top + "/SUMMARY.txt").value_or("");
  CHECK(summary.find("node0          bundled") != std::string::npos);
  CHECK(summary.find("node1          bundled") != std::string::npos);
  CHECK(summary.find("sparkctl_version   same") != std::string::npos);
  CHECK(summary.find("config_digest      same") != std::string::npos);
  for (const char* n : {"node0", "node1"}) {
    std::string d = top + "/nodes/" + n;
    INFO(d);
    auto v = json::parse(read_file(d + "/versions.json").value_or("{}"), nullptr, false);
    CHECK(!v["kernel"]["release"].get<std::string>().empty());
    CHECK(v["engine"]["engine"] == "exec");
    CHECK(v["engine"]["binaries"].size() >= 1);  // the fault server, hashed
    auto p = json::parse(read_file(d + "/preflight.json").value_or("{}"), nullptr, false);
    CHECK(p["node"] == n);
    CHECK(fs::file_size(d + "/capture.tar.gz") > 100);
    CHECK(fs::exists(d + "/kernel.log"));
  }
  // The capture replays: it holds the node's facts.
  auto cap = run({"tar", "-tzf", top + "/nodes/node1/capture.tar.gz"});
  REQUIRE(cap);
  CHECK(cap->out.find("./facts.json") != std::string::npos);
  CHECK(read_file(top + "/nodes/node0/logs/sparkd-0.log").value_or("").find("ready") !=
        std::string::npos);
  auto log1 = read_file(top + "/nodes/node1/logs/sparkd-1.log").value_or("");
  CHECK(log1.find("debug: client sent [REDACTED]; password=[REDACTED]") != std::string::npos);
  auto cluster = read_file(top + "/cluster.env").value_or("");
  CHECK(cluster.find("[REDACTED]") != std::string::npos);
  CHECK(cluster.find("hooks.example.com") != std::string::npos);
  auto all = everything_under(top);
  for (const char* secret : {kPlantedKey, kPlantedToken, kPlantedBearer, kPlantedLog})
    CHECK_MESSAGE(all.find(secret) == std::string::npos, secret, " is in the bundle");

  // node1 unreachable (nothing listens on that port): named, node0 still bundled.
  auto ssh1 = ring.net().ip(2);
  ring.env["NODE1_SSH"] = fmt::format("nobody@{}:2", ssh1);
  auto d = ring.ctl_json({"bundle", "--out", out / "down.tar.gz"}, 240s);
  CHECK_MESSAGE(d.rc == exit_code(Errc::remote), d.all());
  CHECK(d.j["nodes"] == json::array({"node0"}));
  REQUIRE(d.j["missing"].size() == 1);
  CHECK(starts_with(d.j["missing"][0].get<std::string>(), "node1: "));
  REQUIRE(fs::create_directories(out / "y"));
  auto y = run({"tar", "-xzf", out / "down.tar.gz", "-C", out / "y"});
  REQUIRE((y && y->success()));
  for (const auto& e : fs::directory_iterator(out / "y")) top = e.path().string();
  CHECK(read_file(top + "/SUMMARY.txt").value_or("").find("MISSING node1: ") != std::string::npos);
  CHECK(fs::exists(top + "/nodes/node1/ERROR.txt"));
  CHECK(fs::exists(top + "/nodes/node0/capture.tar.gz"));
  (void)ring.ctl({"stop"});
}
