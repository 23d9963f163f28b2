// sparkctl demo-model: deterministic bytes, loads and generates, refuses to clobber,
// embeds the tokenizer fixture when it was present at build time.
#include "daemon/engine/demo_model.h"

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/strings.h"
#include "daemon/engine/engine.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

TEST_CASE("demo-model: same bytes every time, loads, generates, and says its weights are random") {
  test::TempDir dir;
  auto a = write_demo_model(dir / "a", false);
  REQUIRE_MESSAGE(a.ok(), (a.ok() ? std::string() : a.error().message));
  auto b = write_demo_model(dir / "b", false);
  REQUIRE(b.ok());
  CHECK(a->architecture == "Qwen2ForCausalLM");
  CHECK(a->parameters > 3000000);
  CHECK(read_file(dir / "a/model.safetensors") == read_file(dir / "b/model.safetensors"));
  CHECK(read_file(dir / "a/README.md")->find("RANDOM") != std::string::npos);
  // No temporary directory left behind.
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    entries += e.path().filename().string()[0] == '.';
  CHECK(entries == 0);

  const std::string fixture =
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/tokenizer/tokenizer.json";
  if (std::filesystem::exists(fixture)) {
    CHECK(a->tokenizer);
    CHECK(read_file(dir / "a/tokenizer.json") == read_file(fixture));
  } else {
    MESSAGE("SKIP (tokenizer part): " << fixture << " absent in this checkout");
    CHECK_FALSE(a->tokenizer);
    CHECK(a->note.find("tokenizer") != std::string::npos);
  }

  auto m = Model::load(dir / "a", 0, 1);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  CHECK((*m)->config().eos_token_ids == std::vector<int>{2639, 2637});
  auto eng = Engine::start(std::move(*m), std::make_shared<LocalCollective>(), {});
  REQUIRE(eng.ok());
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 8;
  p.ignore_eos = true;
  auto r = generate_blocking(**eng, {2638, 882, 198, 970, 2639, 198, 2638, 771, 198}, p);
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? std::string() : r.error().message));
  CHECK(r->tokens[0].size() == 8);
}

TEST_CASE("demo-model: refuses a non-empty directory that is not a demo, unless --force") {
  test::TempDir dir;
  dir.write("mine/notes.txt", "keep me");
  auto r = write_demo_model(dir / "mine", false);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::precondition);
  CHECK(read_file(dir / "mine/notes.txt") == std::string("keep me"));
  // An earlier demo is replaced without --force.
  REQUIRE(write_demo_model(dir / "demo", false).ok());
  CHECK(write_demo_model(dir / "demo", false).ok());
  // Through the command line, with --json.
  std::ostringstream out, err;
  const char* argv[] = {"sparkctl", "--json", "demo-model", nullptr, "--force"};
  std::string target = dir / "mine";
  argv[3] = target.c_str();
  int rc = cli::run(5, argv, out, err, Environment{});
  INFO(err.str());
  REQUIRE(rc == 0);
  auto j = nlohmann::json::parse(out.str());
  CHECK(j["random_weights"] == true);
  CHECK(j["architecture"] == "Qwen2ForCausalLM");
  CHECK_FALSE(std::filesystem::exists(dir / "mine/notes.txt"));
}

TEST_CASE("demo-model --arch: a mixture of experts of that architecture; an unknown one refused") {
  test::TempDir dir;
  std::ostringstream out, err;
  std::string target = dir / "moe";
  const char* argv[] = {"sparkctl", "--json", "demo-model", target.c_str(), "--arch", "glm4_moe"};
  int rc = cli::run(6, argv, out, err, Environment{});
  INFO(err.str());
  REQUIRE(rc == 0);
  auto j = nlohmann::json::parse(out.str());
  CHECK(j["architecture"] == "Glm4MoeForCausalLM");
  auto m = Model::load(target, 0, 1);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  CHECK((*m)->config().moe.experts == 8);
  CHECK((*m)->config().moe.top_k == 2);

  // An architecture the engine does not run: a usage error naming it and the supported
  // ones, and nothing written.
  std::ostringstream out2, err2;
  std::string bad = dir / "bad";
  const char* argv2[] = {"sparkctl", "demo-model", bad.c_str(), "--arch", "DeepseekV32ForCausalLM"};
  CHECK(cli::run(5, argv2, out2, err2, Environment{}) == 2);
  CHECK(err2.str().find("DeepseekV32ForCausalLM") != std::string::npos);
  CHECK(err2.str().find("Qwen3MoeForCausalLM") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(bad));

  // A weight format it does not write: a usage error naming the value and the choices.
  std::ostringstream out3, err3;
  const char* argv3[] = {"sparkctl", "demo-model", bad.c_str(), "--weights", "int4"};
  CHECK(cli::run(5, argv3, out3, err3, Environment{}) == 2);
  CHECK(err3.str().find("--weights int4") != std::string::npos);
  CHECK(err3.str().find("bf16, fp8") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(bad));
}

TEST_CASE("demo-model --arch deepseek_v3: latent attention that loads and generates on the CPU") {
  test::TempDir dir;
  std::ostringstream out, err;
  std::string target = dir / "dsv3";
  const char* argv[] = {"sparkctl",     "--json", "demo-model",
                        target.c_str(), "--arch", "deepseek_v3"};
  int rc = cli::run(6, argv, out, err, Environment{});
  INFO(err.str());
  REQUIRE(rc == 0);
  CHECK(nlohmann::json::parse(out.str())["architecture"] == "DeepseekV3ForCausalLM");
  auto m = Model::load(target, 0, 1);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? std::string() : m.error().message));
  const auto& c = (*m)->config();
  CHECK(c.is_mla());
  CHECK(c.mla.q_lora_rank > 0);
  CHECK(c.moe.shared_inter > 0);
  CHECK_FALSE(c.moe.is_moe(0));
  auto cache = (*m)->make_kv_cache(8, 16, ElemType::f32);
  REQUIRE(cache.ok());
  std::vector<int32_t> tok = {5, 77, 301, 12}, table = {3, 1};
  LocalCollective one;
  std::vector<float> logits;
  SeqChunk ch{tok.data(), 4, 0, table.data(), true};
  REQUIRE((*m)->forward({ch}, **cache, one, &logits).ok());
  REQUIRE(logits.size() == static_cast<size_t>(c.vocab_size));
  for (float v : logits) REQUIRE(std::isfinite(v));
}
