// Preflight's model.engine check and `sparkctl plan`'s engine line: whether the configured
// engine can serve a model directory, decided by the native engine's own config reader and
// shard plan, the shards' tensor types and the tokenizer's files.
#include "env/engine_fit.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/strings.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/shard_plan.h"
#include "env/plan.h"
#include "env/preflight.h"
#include "env/rank_env.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::env;
namespace fs = std::filesystem;

namespace {

const std::string kModels = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/models/";

bool has(const std::vector<std::string>& v, const std::string& part) {
  for (const auto& s : v)
    if (s.find(part) != std::string::npos) return true;
  return false;
}

RingConfig ring(const std::string& extra) {
  auto cfg = load_config_text("NODE0_SSH=local\n" + extra, "t.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? std::string() : cfg.error().message));
  return *cfg;
}

// A copy of a fixture checkpoint (config.json, shards, index) with a tokenizer.json.
std::string checkpoint(test::TempDir& d, const std::string& fixture) {
  std::string dir = d / fixture;
  fs::copy(kModels + fixture, dir, fs::copy_options::recursive);
  d.write(fixture + "/tokenizer.json", R"({"version":"1.0","model":{"type":"BPE"}})");
  return dir;
}

// A one-tensor safetensors file whose tensor has `dtype` (the header as the format defines
// it: an 8-byte little-endian length, the JSON, the data).
std::string one_tensor(const std::string& dtype, size_t bytes) {
  std::string h = fmt::format(R"({{"model.layers.0.mlp.down_proj.weight":{{"dtype":"{}",)"
                              R"("shape":[{}],"data_offsets":[0,{}]}}}})",
                              dtype, bytes, bytes);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
  return out + h + std::string(bytes, '\0');
}

// A random-weight checkpoint of `family` (bf16) with a tokenizer.json, in d/model.
std::string random_model(test::TempDir& d, engine::Family family) {
  const std::string dir = d / "model";
  REQUIRE(engine::write_random_checkpoint(dir,
                                          {engine::small_config(family), engine::DType::bf16, 7, 1})
              .ok());
  d.write("model/tokenizer.json", R"({"version":"1.0","model":{"type":"BPE"}})");
  return dir;
}

}  // namespace

TEST_CASE("engine fit: a bf16 checkpoint of a family the engine runs is served, and says what") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");
  auto cfg = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=512\n");
  auto f = engine_fit(read_model_files(Sysroot("/"), dir), &cfg, {});
  CHECK(f.checked);
  CHECK_MESSAGE(f.ok(), join(f.problems, "; "));
  CHECK(f.warnings.empty());
  CHECK(f.summary.find("Qwen3ForCausalLM") != std::string::npos);
  CHECK(f.summary.find("BF16") != std::string::npos);
}

TEST_CASE(
    "engine fit: an architecture the engine does not run is refused with ENGINE=exec as the fix") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");
  fs::copy_file(kModels + "plan/glm-5.3-flash/config.json", dir + "/config.json",
                fs::copy_options::overwrite_existing);
  auto cfg = ring("MODEL_PATH=" + dir + "\n");
  auto f = engine_fit(read_model_files(Sysroot("/"), dir), &cfg, {});
  CHECK(f.checked);
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.problems, "is not supported; supported: "));
  CHECK(has(f.fixes, "ENGINE=exec"));
  // ENGINE=exec: its command decides; nothing to refuse here.
  auto exec = ring("MODEL_PATH=" + dir + "\nENGINE=exec\nENGINE_EXEC=true\n");
  auto e = engine_fit(read_model_files(Sysroot("/"), dir), &exec, {});
  CHECK_FALSE(e.checked);
  CHECK(e.ok());
}

TEST_CASE(
    "engine fit: FP8 tensors only where config.json declares them; other quantizations refused") {
  test::TempDir d("fit");
  d.write("fp8/config.json", *read_file(kModels + "qwen3/config.json"));
  d.write("fp8/tokenizer.json", "{}");
  d.write("fp8/model.safetensors", one_tensor("F8_E4M3", 16));
  auto cfg = ring("MODEL_PATH=" + d / "fp8" + "\n");
  auto f = engine_fit(read_model_files(Sysroot("/"), d / "fp8"), &cfg, {});
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.problems,
            "1 tensor(s) are F8_E4M3 (e.g. model.layers.0.mlp.down_proj.weight); the native "
            "engine loads F32, BF16 and F16"));
  CHECK(has(f.fixes, "ENGINE=exec"));

  // Declared as the FP8 checkpoints declare it: the engine reads them.
  auto q = nlohmann::json::parse(*read_file(kModels + "qwen3/config.json"));
  q["quantization_config"] = {{"quant_method", "fp8"},
                              {"fmt", "e4m3"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}}};
  d.write("fp8/config.json", q.dump());
  auto g = engine_fit(read_model_files(Sysroot("/"), d / "fp8"), &cfg, {});
  CHECK_MESSAGE(g.ok(), join(g.problems, "; "));

  // A method the engine does not read is refused naming it.
  q["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
  d.write("fp8/config.json", q.dump());
  d.write("fp8/model.safetensors", one_tensor("BF16", 16));
  auto h = engine_fit(read_model_files(Sysroot("/"), d / "fp8"), &cfg, {});
  REQUIRE_FALSE(h.ok());
  CHECK(has(h.problems, "quantization_config.quant_method = \"awq\" is not supported"));
  CHECK(has(h.fixes, "ENGINE=exec"));
}

TEST_CASE("engine fit: rank 0's node needs tokenizer.json; the others do not") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");
  fs::remove(dir + "/tokenizer.json");
  auto cfg = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=512\n");
  auto mf = read_model_files(Sysroot("/"), dir);
  auto f = engine_fit(mf, &cfg, {});
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.problems, dir + "/tokenizer.json is missing"));
  EngineFitOptions worker;
  worker.needs_tokenizer = false;
  CHECK(engine_fit(mf, &cfg, worker).ok());
}

TEST_CASE(
    "engine fit: CONTEXT_LEN above max_position_embeddings: set, an error; default, a warning") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");  // max_position_embeddings 512
  auto mf = read_model_files(Sysroot("/"), dir);
  auto set = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=4096\n");
  auto f = engine_fit(mf, &set, {});
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.problems, "CONTEXT_LEN 4096 is above the model's max_position_embeddings 512"));
  CHECK(has(f.fixes, "set CONTEXT_LEN=512"));
  auto dflt = ring("MODEL_PATH=" + dir + "\n");  // CONTEXT_LEN's default, 4096
  auto g = engine_fit(mf, &dflt, {});
  CHECK(g.ok());
  CHECK(has(g.warnings,
            "CONTEXT_LEN 4096 (the default) is above the model's "
            "max_position_embeddings 512: the engine serves 512 tokens"));
}

TEST_CASE("engine fit: a ring whose ranks the heads do not divide is refused before start") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");  // 4 heads, 2 KV heads
  auto cfg = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=512\nNODE0_GPUS=0,1,2\n");
  EngineFitOptions o;
  o.world = cfg.world_size();
  auto f = engine_fit(read_model_files(Sysroot("/"), dir), &cfg, o);
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.fixes, "number of ranks"));
}

TEST_CASE(
    "preflight model.engine: FAIL for a model the native engine refuses, PASS for one it runs") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");
  auto cfg = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=512\n");
  CheckFilter only;
  only.only = {"model.engine"};
  auto ok = run_node_checks(cfg, 0, Sysroot("/"), only, false);
  REQUIRE(ok.checks.size() == 1);
  CHECK_MESSAGE(ok.checks[0].verdict == Verdict::pass, ok.checks[0].message);
  fs::copy_file(kModels + "plan/deepseek-v3.2/config.json", dir + "/config.json",
                fs::copy_options::overwrite_existing);
  auto bad = run_node_checks(cfg, 0, Sysroot("/"), only, false);
  REQUIRE(bad.checks.size() == 1);
  CHECK(bad.checks[0].verdict == Verdict::fail);
  CHECK(bad.checks[0].message.find("ENGINE=native cannot serve " + dir) != std::string::npos);
  CHECK(bad.checks[0].fix.find("ENGINE=exec") != std::string::npos);
}

TEST_CASE("plan: says the configured engine cannot serve the model, with the fix") {
  test::TempDir d("fit");
  auto dir = checkpoint(d, "qwen3");
  fs::copy_file(kModels + "plan/glm-5.3-flash/config.json", dir + "/config.json",
                fs::copy_options::overwrite_existing);
  auto file = d.write("ring.env", "NODE0_SSH=local\nMODEL_PATH=" + dir + "\n");
  std::ostringstream out, err;
  std::vector<const char*> argv = {"sparkctl", "--config",   file.c_str(),
                                   "plan",     "--capacity", "1TiB"};
  int rc = cli::run(static_cast<int>(argv.size()), argv.data(), out, err, Environment{});
  CHECK(rc == 0);
  CHECK(out.str().find("# ENGINE=native CANNOT SERVE THIS MODEL: ") != std::string::npos);
  CHECK(out.str().find("# fix: serve it with an engine that runs it: ENGINE=exec") !=
        std::string::npos);
  CHECK(err.str().find("ENGINE=native cannot serve " + dir) != std::string::npos);
}

TEST_CASE(
    "engine fit: latent attention (DeepSeek-V3) and gpt-oss are served on a GPU and on the CPU") {
  for (auto family : {engine::Family::deepseek_v3, engine::Family::gpt_oss}) {
    CAPTURE(engine::architecture_name(family));
    test::TempDir d("fit");
    const std::string dir = random_model(d, family);
    for (const char* device : {"", "DEVICE=cpu\n", "DEVICE=cuda\n"}) {
      CAPTURE(device);
      auto r = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=256\n" + device);
      auto f = engine_fit(read_model_files(Sysroot("/"), dir), &r, {});
      CHECK(f.checked);
      CHECK_MESSAGE(f.ok(), join(f.problems, "; "));
      CHECK_MESSAGE(f.warnings.empty(), join(f.warnings, "; "));
    }
  }
}

// KV_DTYPE the native engine has no cache of: refused before start, with the fix; fp8 is
// served except for latent attention.
TEST_CASE("engine fit: KV_DTYPE=fp16, and fp8 for latent attention, are refused before start") {
  for (auto family : {engine::Family::qwen3, engine::Family::deepseek_v3}) {
    CAPTURE(engine::architecture_name(family));
    test::TempDir d("fit");
    const std::string dir = random_model(d, family);
    const bool mla = family == engine::Family::deepseek_v3;
    for (const char* kv : {"auto", "fp8", "fp16"}) {
      CAPTURE(kv);
      auto r = ring("MODEL_PATH=" + dir + "\nCONTEXT_LEN=256\nKV_DTYPE=" + kv + "\n");
      auto f = engine_fit(read_model_files(Sysroot("/"), dir), &r, {});
      CHECK(f.checked);
      const bool refused = std::string(kv) == "fp16" || (std::string(kv) == "fp8" && mla);
      CHECK_MESSAGE(f.ok() == !refused, join(f.problems, "; "));
      if (refused) {
        CHECK(has(f.problems, std::string("KV_DTYPE=") + kv));
        CHECK(has(f.fixes, "KV_DTYPE=auto"));
      }
    }
  }
}

TEST_CASE("plan: gpt-oss-120b's experts are counted packed, as the engine holds them") {
  // gpt-oss-120b's config (bench/engine/shapes): MXFP4 experts kept packed come to about 65
  // GB on one rank; widened into bf16 they would be about 234.
  test::TempDir d("packed");
  auto text = read_file(std::string(SPARK_SOURCE_DIR) + "/bench/engine/shapes/gpt-oss-120b.json");
  REQUIRE(text.has_value());
  d.write("model/config.json", *text);
  const std::string dir = d / "model";
  auto mc = engine::load_model_config(dir);
  REQUIRE_MESSAGE(mc.ok(), (mc.ok() ? std::string() : mc.error().message));
  auto sp = engine::make_shard_plan(*mc, 0, 1, dir);
  REQUIRE(sp.ok());
  auto r = ring("MODEL_PATH=" + dir + "\n");
  auto pi = plan_input(read_model_files(Sysroot("/"), dir), &r);
  REQUIRE_MESSAGE(pi.ok(), (pi.ok() ? std::string() : pi.error().message));
  REQUIRE(pi->engine_weights);
  const auto p = pi->engine_weights(1, plan::MoeSplit::automatic);
  REQUIRE(p.has_value());
  CHECK(*p == sp->held_bytes(2, 2, true, true));
  CHECK(sp->held_bytes(2, 2, true, false) > 3 * *p);
  CHECK(*p < 68'000'000'000ull);
}
