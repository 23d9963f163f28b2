// Engine pinning (cli/engine_pin.h): the image found through the fault-injection container
// runtime, the pinned command, and rollback's refusals.
#include "cli/engine_pin.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include "support/tempdir.h"

using namespace spark;
using nlohmann::json;

TEST_CASE("engine pin: the runtime names the image; the command is pinned by digest") {
  test::TempDir fd("spark-fault-docker");
  const std::string id = "sha256:" + std::string(64, 'c');
  fd.write("tags/vllm_vllm-openai_nightly", id + "\n");
  auto docker = fd.write("bin/docker", fmt::format("#!/bin/sh\nFAULT_DOCKER_DIR={} exec "
                                                   "{}/tests/support/fault_docker/docker \"$@\"\n",
                                                   fd.path(), SPARK_SOURCE_DIR));
  REQUIRE(::chmod(docker.c_str(), 0755) == 0);
  std::string cmd = docker +
                    " run --gpus all -e HF_TOKEN=x --ipc host vllm/vllm-openai:nightly "
                    "vllm serve /m --port 8001";
  auto pin = cli::image_of_command(cmd);
  REQUIRE(pin);
  CHECK(pin->runtime == "docker");
  CHECK(pin->ref == "vllm/vllm-openai:nightly");
  CHECK(pin->id == id);
  CHECK(pin->digest == "vllm/vllm-openai@" + id);
  auto pinned = cli::pin_command(cmd, *pin);
  CHECK(pinned.find(" vllm/vllm-openai@" + id + " vllm serve") != std::string::npos);
  CHECK(pinned.find(":nightly") == std::string::npos);
  CHECK_FALSE(cli::image_of_command("vllm serve /m"));
  CHECK_FALSE(cli::image_of_command(docker + " run --rm unknown/image:tag true"));
}

TEST_CASE("engine pin: rollback refuses a changed binary and images that differ by node") {
  cli::EngineSet last;
  last.config_text =
      "ENGINE=\"exec\"\nENGINE_EXEC=\"docker run img:1 serve\"\nNODE0_SSH=\"local\"\n"
      "NODE0_FABRIC_IP=\"10.0.0.1\"\nNODE0_NETDEVS=\"eth0\"\n";
  last.nodes = json::array(
      {{{"node", "a"},
        {"image",
         {{"runtime", "docker"}, {"ref", "img:1"}, {"id", "sha256:1"}, {"digest", "img@sha256:1"}}},
        {"binaries", json::array({{{"path", "/opt/e"}, {"xxh3", "11"}}})}}});
  cli::EngineSet now = last;
  auto cfg = cli::rollback_config(last, now);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  CHECK(cfg->get("ENGINE_EXEC") == "docker run img@sha256:1 serve");
  now.nodes[0]["binaries"][0]["xxh3"] = "22";
  auto changed = cli::rollback_config(last, now);
  REQUIRE_FALSE(changed.ok());
  CHECK(changed.error().code == Errc::integrity);
  CHECK(changed.error().message.find("a: /opt/e changed since the last good start") !=
        std::string::npos);
  auto two = last;
  two.nodes.push_back(two.nodes[0]);
  two.nodes[1]["node"] = "b";
  two.nodes[1]["image"]["id"] = "sha256:2";
  auto split = cli::rollback_config(two, two);
  REQUIRE_FALSE(split.ok());
  CHECK(split.error().message.find("pull the same image on every node") != std::string::npos);
}
