// sparkctl config show | check, through the real command table: provenance of every value
// (file:line, environment, default), exit codes, findings in file order, --json.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "support/tempdir.h"

using namespace spark;

namespace {

struct CliResult {
  int rc = 0;
  std::string out, err;
};

CliResult config_cli(std::vector<const char*> argv, std::map<std::string, std::string> vars = {}) {
  std::ostringstream o, e;
  argv.insert(argv.begin(), "sparkctl");
  Environment env;
  env.vars = std::move(vars);
  CliResult r;
  r.rc = cli::run(static_cast<int>(argv.size()), argv.data(), o, e, env);
  r.out = o.str();
  r.err = e.str();
  return r;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("config show: values and where they came from, the environment winning") {
  test::TempDir dir;
  auto file = dir.write("ring.env", "# ring\nNODE0_SSH=local\nAPI_PORT=8000\nMODEL=a\n");
  auto r = config_cli({"--config", file.c_str(), "--json", "config", "show", "--all"},
                      {{"API_PORT", "8100"}, {"MODEL", ""}});
  REQUIRE_MESSAGE(r.rc == 0, r.err);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["settings"]["NODE0_SSH"]["source"] == file + ":2");
  CHECK(j["settings"]["API_PORT"]["value"] == "8100");
  CHECK(j["settings"]["API_PORT"]["source"] == "environment");
  CHECK(j["settings"]["MODEL"]["value"] == "");
  CHECK(j["settings"]["RDZV_PORT"]["source"] == "default");
  CHECK(j["world_size"] == 1);

  auto t = config_cli({"--config", file.c_str(), "config", "show"}, {{"API_PORT", "8100"}});
  REQUIRE(t.rc == 0);
  CHECK(has(t.out, "API_PORT"));
  CHECK(has(t.out, "environment"));
  CHECK(has(t.out, file + ":4"));  // MODEL
}

TEST_CASE("config check: exit codes 0, 3, 4 and findings in file order") {
  test::TempDir dir;
  auto good = dir.write("good.env", "NODE0_SSH=local\nMY_OWN_NOTE=1\n");
  auto r = config_cli({"--config", good.c_str(), "config", "check"});
  CHECK(r.rc == 0);
  CHECK(has(r.out, ": OK (1 node(s), 1 rank(s)"));
  CHECK(has(r.err, good + ":2: warning: unknown key MY_OWN_NOTE; it is ignored"));

  // A required key misspelt is not OK: the ring would run without it.
  auto typo = dir.write("typo.env", "NODE0_SSH=local\nMODLE_PATH=/models/m\n");
  auto t = config_cli({"--config", typo.c_str(), "config", "check"});
  CHECK(t.rc == 3);
  CHECK(has(t.err, typo + ":2: error: unknown key MODLE_PATH (did you mean MODEL_PATH?)"));
  CHECK_FALSE(has(t.out, ": OK"));

  // A missing cluster file: the reason, and where the package keeps its own.
  auto none = config_cli({"--config", (dir / "nope.env").c_str(), "config", "check"});
  CHECK(none.rc == 4);
  CHECK(has(none.err, "nope.env: cannot read the cluster file: No such file or directory"));
  CHECK(has(none.err, "/etc/sparkctl/ring.env"));

  auto bad =
      dir.write("bad.env", "ZZZ=1\nNODE0_SSH=local\nNODE1_SSH=<worker>\nAPI_PORT=70000\nSLOTS=0\n");
  auto b = config_cli({"--config", bad.c_str(), "config", "check"});
  CHECK(b.rc == 3);
  auto p1 = b.err.find(bad + ":1: warning");
  auto p3 = b.err.find(bad + ":3: error");
  auto p4 = b.err.find(bad + ":4: error");
  auto p5 = b.err.find(bad + ":5: error");
  REQUIRE(p1 != std::string::npos);
  REQUIRE(p3 != std::string::npos);
  REQUIRE(p4 != std::string::npos);
  REQUIRE(p5 != std::string::npos);
  CHECK(p1 < p3);
  CHECK(p3 < p4);
  CHECK(p4 < p5);

  auto j = config_cli({"--config", bad.c_str(), "--json", "config", "check"});
  CHECK(j.rc == 3);
  auto jj = nlohmann::json::parse(j.out);
  CHECK(jj["ok"] == false);
  CHECK(jj["diagnostics"].size() >= 4);
  CHECK(jj["diagnostics"][0]["where"] == bad + ":1");

  auto syntax = dir.write("syntax.env", "NODE0_SSH=local\nA = 1\n");
  auto s = config_cli({"--config", syntax.c_str(), "config", "check"});
  CHECK(s.rc == 3);
  CHECK(has(s.err, syntax + ":2:2:"));

  auto missing = config_cli({"--config", (dir / "none.env").c_str(), "config", "check"});
  CHECK(missing.rc == 4);
  CHECK(has(missing.err, "none.env"));
}

TEST_CASE("config: SPARK_CONFIG names the file when --config does not") {
  test::TempDir dir;
  auto file = dir.write("ring.env", "NODE0_SSH=local\n");
  auto r = config_cli({"config", "check"}, {{"SPARK_CONFIG", file}});
  CHECK(r.rc == 0);
  CHECK(has(r.out, file));
  auto u = config_cli({"config", "frobnicate"}, {{"SPARK_CONFIG", file}});
  CHECK(u.rc == 2);
}

TEST_CASE("config check refuses the API key files that start refuses") {
  test::TempDir dir;
  auto check = [&](const std::string& content, mode_t mode) {
    auto key = dir.write("key", content);
    ::chmod(key.c_str(), mode);
    auto file = dir.write("ring.env", "NODE0_SSH=local\nAPI_KEY_FILE=" + key + "\n");
    return config_cli({"--config", file.c_str(), "config", "check"});
  };
  auto two = check("first\nsecond\n", 0600);
  CHECK(two.rc == 3);
  CHECK(has(two.err, "ring.env:2: error: API_KEY_FILE"));
  CHECK(has(two.err, "more than one line"));
  auto open = check("k\n", 0644);
  CHECK(open.rc == 3);
  CHECK(has(open.err, "mode 0644"));
  CHECK(has(open.err, "chmod 600"));
  CHECK(check("\n", 0600).rc == 3);
  CHECK(has(check("a b\n", 0600).err, "space or control character"));
  auto good = check("s3cret\n", 0600);
  CHECK_MESSAGE(good.rc == 0, good.err);
}
