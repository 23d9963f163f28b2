#include <doctest/doctest.h>

#include "core/config.h"

using namespace spark;

TEST_CASE("a minimal local ring resolves with defaults and provenance") {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text("NODE0_SSH=local\n", "t.env", env, &d);
  REQUIRE(cfg.ok());
  CHECK(cfg->nodes.size() == 1);
  CHECK(cfg->nodes[0].local);
  CHECK(cfg->nodes[0].fabric_ip == "127.0.0.1");
  CHECK(cfg->get("API_PORT") == "8000");
  CHECK(cfg->settings.at("API_PORT").source == "default");
  CHECK(cfg->settings.at("NODE0_SSH").source == "t.env:1");
}
