// Every example cluster file in env/examples/ validates: no errors, no warnings. They are
// the tutorial; a key renamed in the schema must be renamed there too.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>

#include "core/config.h"

using namespace spark;

TEST_CASE("examples: every env/examples/*.env validates without warnings") {
  std::map<std::string, size_t> expect_nodes = {
      {"local.env", 1}, {"two-sparks.env", 2}, {"three-sparks.env", 3}, {"four-sparks.env", 4}};
  std::vector<std::string> seen;
  for (const auto& e : std::filesystem::directory_iterator(SPARK_SOURCE_DIR "/env/examples")) {
    if (e.path().extension() != ".env") continue;
    std::string name = e.path().filename().string();
    seen.push_back(name);
    INFO(name);
    std::vector<Diagnostic> d;
    auto cfg = load_config(e.path().string(), Environment{}, &d);  // no caller environment
    REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
    for (const auto& x : d) FAIL_CHECK(x.where << ": " << x.message);
    if (auto it = expect_nodes.find(name); it != expect_nodes.end())
      CHECK(cfg->nodes.size() == it->second);
  }
  for (const auto& e : expect_nodes) {
    const std::string& name = e.first;
    INFO(name);
    CHECK(std::find(seen.begin(), seen.end(), name) != seen.end());
  }
}

TEST_CASE("examples: two-sparks pairs both twins and leaves the GID index to auto") {
  std::vector<Diagnostic> d;
  auto cfg = load_config(SPARK_SOURCE_DIR "/env/examples/two-sparks.env", Environment{}, &d);
  REQUIRE(cfg.ok());
  for (const auto& n : cfg->nodes) {
    CHECK(n.netdevs == std::vector<std::string>{"enp1s0f0np0", "enp1s0f1np1"});
    CHECK(n.hcas == std::vector<std::string>{"rocep1s0f0", "rocep1s0f1"});
    CHECK_FALSE(n.gid_index.has_value());
    CHECK_FALSE(n.local);
  }
  CHECK(cfg->nodes[0].fabric_ip == "10.10.2.1");
  CHECK(cfg->world_size() == 2);
}
