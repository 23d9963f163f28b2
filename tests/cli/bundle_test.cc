// sparkctl bundle's pure parts (cli/bundle.h): the per-node diff and the redacted cluster file.
#include "cli/bundle.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>

#include "core/envfile.h"
#include "support/tempdir.h"

using namespace spark;
using nlohmann::json;

namespace {
json node_doc(const std::string& kernel, const std::string& nccl, const std::string& cmdline) {
  return {{"versions",
           {{"kernel", {{"release", kernel}, {"machine", "aarch64"}}},
            {"cmdline", cmdline},
            {"hca_firmware", {{"rocep1s0f0", {{"fw_ver", "28.45.1020"}}}}}}},
          {"identity", {{"nccl_version", nccl}, {"config_digest", "abc"}}}};
}
const cli::FieldDiff& field(const std::vector<cli::FieldDiff>& d, const std::string& name) {
  for (const auto& f : d)
    if (f.field == name) return f;
  FAIL("no field " << name);
  return d.front();
}
}  // namespace

TEST_CASE(
    "bundle diff: a field that differs is marked; per-host tokens of the command line are not") {
  auto d = cli::diff_nodes(
      {node_doc("6.11.0-1016-nvidia", "2.27.3", "BOOT_IMAGE=/vmlinuz-a root=UUID=1 kho=off quiet"),
       node_doc("6.11.0-1016-nvidia", "2.26.2",
                "BOOT_IMAGE=/vmlinuz-b root=UUID=2 kho=off quiet")});
  CHECK_FALSE(field(d, "kernel").differs);
  CHECK(field(d, "nccl_version").differs);
  CHECK(field(d, "nccl_version").values == std::vector<std::string>{"2.27.3", "2.26.2"});
  CHECK_FALSE(field(d, "kernel_cmdline").differs);
  CHECK(field(d, "kernel_cmdline").values[0] == "kho=off quiet");
  CHECK_FALSE(field(d, "hca_firmware").differs);
  CHECK(field(d, "hca_firmware").values[0] == "rocep1s0f0 28.45.1020");

  auto k =
      cli::diff_nodes({node_doc("6.11.0", "2.27.3", "kho=off"), node_doc("7.0.1", "2.27.3", "")});
  CHECK(field(k, "kernel").differs);
  CHECK(field(k, "kernel_cmdline").differs);

  cli::BundleReport rep;
  rep.nodes = {"spark-a", "spark-b"};
  rep.missing = {"spark-c: connection refused"};
  rep.diff = k;
  RingConfig cfg;
  auto text = cli::summary_text(cfg, rep, "2026-01-01T00:00:00Z");
  CHECK(text.find("MISSING spark-c: connection refused") != std::string::npos);
  CHECK(text.find("kernel             DIFFERS spark-a 6.11.0; spark-b 7.0.1") != std::string::npos);
  CHECK(text.find("nccl_version       same   2.27.3") != std::string::npos);
}

TEST_CASE("bundle: the cluster file goes in with its secrets redacted") {
  test::TempDir dir("spark-bundle");
  auto key = dir.write("api.key", "sk-planted-0123456789abcdef\n");
  REQUIRE(::chmod(key.c_str(), 0600) == 0);
  auto path = dir.write(
      "c.env", "RING_NAME=r\nMODEL_PATH=/m\nENGINE=exec\nAPI_KEY_FILE=" + key +
                   "\nENGINE_EXEC='HF_TOKEN=hf_plantedtoken0123456789 vllm serve /m --api-key "
                   "planted-cli-key'\nWATCH_ALERT_CMD='curl -H \"Authorization: Bearer "
                   "planted-bearer-77\" https://hooks.example.com/t'\n"
                   "NODE0_SSH=local\nNODE0_FABRIC_IP=10.0.0.1\nNODE0_NETDEVS=eth0\n");
  Environment env;
  auto cfg = load_config(path, env, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  auto text = cli::redacted_config_text(*cfg);
  for (const char* s : {"hf_plantedtoken0123456789", "planted-cli-key", "planted-bearer-77",
                        "sk-planted-0123456789abcdef"})
    CHECK_MESSAGE(text.find(s) == std::string::npos, s, " leaked into\n", text);
  CHECK(text.find("vllm serve /m") != std::string::npos);
  CHECK(text.find("API_KEY_FILE=\"" + key + "\"") != std::string::npos);  // the path, not the key
  // The key itself is known by value and redacted from any text.
  auto known = cli::known_secrets(*cfg);
  CHECK(std::find(known.begin(), known.end(), "sk-planted-0123456789abcdef") != known.end());
}
