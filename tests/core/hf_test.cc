// The Hugging Face readers (core/hf/): config.json and model.safetensors.index.json, and that
// preflight, the planner and the engine read each file through the same one.
#include <doctest/doctest.h>

#include <string>

#include "core/hf/config.h"
#include "core/hf/safetensors_index.h"
#include "core/model_plan.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/model_config.h"
#include "env/model_files.h"
#include "env/plan.h"
#include "support/tempdir.h"

using namespace spark;

TEST_CASE("hf config: fields as written, rope in both spellings, nulls are absent") {
  auto c = hf::parse_config_text(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": null, "rms_norm_eps": 1e-5, "rope_theta": 500000,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "eos_token_id": [128001, 128009, 128001], "torch_dtype": "bfloat16", "attention_bias": false
  })",
                                 "m/config.json");
  REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.error().message));
  CHECK(c->architectures == std::vector<std::string>{"LlamaForCausalLM"});
  CHECK(c->num_key_value_heads == 8);
  CHECK_FALSE(c->head_dim.has_value());
  CHECK(c->rope_theta == 500000.0);
  REQUIRE(c->rope_scaling.has_value());
  CHECK(c->rope_scaling->type == "llama3");
  CHECK(c->rope_scaling->factor == 8.0);
  CHECK(c->eos_token_ids == std::vector<int>{128001, 128009});
  CHECK(c->dtype == "bfloat16");

  // transformers 5: rope_parameters carries rope_theta; dtype replaces torch_dtype.
  auto v5 = hf::parse_config_text(
      R"({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2},
          "torch_dtype": "float16", "dtype": "float32"})",
      "v5.json");
  REQUIRE(v5.ok());
  CHECK(v5->rope_theta == 1e6);
  CHECK(v5->rope_scaling->type == "linear");
  CHECK(v5->rope_scaling->factor == 2.0);
  CHECK(v5->dtype == "float32");
}

TEST_CASE("hf config: a multimodal checkpoint's text_config gives the model fields") {
  auto c = hf::parse_config_text(
      R"({"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
          "text_config": {"num_hidden_layers": 48, "num_key_value_heads": 16,
                          "head_dim": 128, "model_type": "gemma3_text"}})",
      "config.json");
  REQUIRE(c.ok());
  CHECK(c->num_hidden_layers == 48);
  CHECK(c->head_dim == 128);
  CHECK(c->model_type == "gemma3_text");
  CHECK(c->dtype == "bfloat16");
}

TEST_CASE("hf config: a wrong type is an error naming the file and the key") {
  auto bad = hf::parse_config_text(R"({"num_hidden_layers": "32"})", "/m/config.json");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::config);
  CHECK(bad.error().message ==
        "/m/config.json: \"num_hidden_layers\" must be a non-negative integer");
  CHECK_FALSE(hf::parse_config_text(R"({"num_attention_heads": -1})", "c").ok());
  CHECK_FALSE(hf::parse_config_text(R"({"tie_word_embeddings": "yes"})", "c").ok());
  CHECK_FALSE(hf::parse_config_text(R"({"architectures": "LlamaForCausalLM"})", "c").ok());
  CHECK_FALSE(hf::parse_config_text(R"({"rope_scaling": {"factor": "8"}})", "c").ok());
  auto not_json = hf::parse_config_text("[1, 2]", "c.json");
  REQUIRE_FALSE(not_json.ok());
  CHECK(not_json.error().message == "c.json: not a JSON object");
  // Text that is not JSON says where; Python's NaN and Infinity say what.
  auto nan =
      hf::parse_config_text("{\n  \"hidden_size\": 64,\n  \"rms_norm_eps\": NaN\n}", "c.json");
  REQUIRE_FALSE(nan.ok());
  CHECK(nan.error().code == Errc::config);
  CHECK(nan.error().message.find("c.json: line 3, column ") == 0);
  CHECK(nan.error().message.find("NaN is not JSON") != std::string::npos);
  auto inf = hf::parse_config_text(R"({"rope_theta": -Infinity})", "c.json");
  REQUIRE_FALSE(inf.ok());
  CHECK(inf.error().message.find("Infinity is not JSON") != std::string::npos);
  auto cut = hf::parse_config_text("{\"a\": 1,\n", "c.json");
  REQUIRE_FALSE(cut.ok());
  CHECK(cut.error().message.find("c.json: line 2, column ") == 0);
  CHECK(cut.error().message.find("not valid JSON") != std::string::npos);
  // A number no JSON number type holds is a config error, not an escaped exception.
  auto huge = hf::parse_config_text(R"({"vocab_size": 1E4444})", "c.json");
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().code == Errc::config);
  CHECK(huge.error().message.find("c.json: ") == 0);
  CHECK(huge.error().message.find("number overflow") != std::string::npos);
}

TEST_CASE("hf config: load_config adds generation_config.json's eos ids") {
  test::TempDir d;
  d.write("config.json", R"({"eos_token_id": 2})");
  d.write("generation_config.json", R"({"eos_token_id": [2, 7]})");
  auto c = hf::load_config(d.path());
  REQUIRE(c.ok());
  CHECK(c->eos_token_ids == std::vector<int>{2, 7});
  auto none = hf::load_config(d / "absent");
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().code == Errc::not_found);
}

TEST_CASE("hf safetensors index: shards once and sorted, total size, names stay inside") {
  auto idx = hf::parse_safetensors_index(
      R"({"metadata": {"total_size": 16060522496},
          "weight_map": {"b": "model-00002-of-00002.safetensors",
                         "a": "model-00001-of-00002.safetensors",
                         "c": "model-00002-of-00002.safetensors"}})",
      "m/model.safetensors.index.json");
  REQUIRE(idx.ok());
  CHECK(idx->files == std::vector<std::string>{"model-00001-of-00002.safetensors",
                                               "model-00002-of-00002.safetensors"});
  CHECK(idx->weight_map.at("c") == "model-00002-of-00002.safetensors");
  CHECK(idx->total_size == 16060522496ull);

  auto no_map = hf::parse_safetensors_index(R"({"metadata": {}})", "i.json");
  REQUIRE_FALSE(no_map.ok());
  CHECK(no_map.error().code == Errc::integrity);
  CHECK(no_map.error().message.find("i.json: not a safetensors index") == 0);
  for (const char* name : {"../x.safetensors", "sub/x.safetensors", "", ".."}) {
    auto bad = hf::parse_safetensors_index(
        std::string(R"({"weight_map": {"t": ")") + name + R"("}})", "i.json");
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.error().message.find("is not a plain file name") != std::string::npos);
  }
  CHECK_FALSE(hf::parse_safetensors_index(R"({"weight_map": {"t": 3}})", "i.json").ok());
}

// One reader: a file that the reader refuses is refused with its words by preflight, the
// planner and the engine alike.
TEST_CASE("hf readers: preflight, the planner and the engine share them") {
  const std::string bad_cfg =
      R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2.5})";
  const std::string want = "\"num_hidden_layers\" must be a non-negative integer";
  auto engine = engine::parse_model_config(bad_cfg, "config.json");
  REQUIRE_FALSE(engine.ok());
  CHECK(engine.error().message == "config.json: " + want);
  auto plan = plan::model_shape(nlohmann::json::parse(bad_cfg), "config.json");
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.error().message == "config.json: " + want);

  test::TempDir d;
  d.write("m/config.json", bad_cfg);
  d.write("m/model.safetensors.index.json", R"({"weight_map": {"t": "../outside.safetensors"}})");
  auto mf = env::read_model_files(env::Sysroot("/"), d / "m");
  CHECK_FALSE(mf.config_ok);
  CHECK(mf.config_error == "config.json: " + want);
  CHECK(mf.index_error.find("is not a plain file name") != std::string::npos);
  auto ck = engine::Checkpoint::open(d / "m");
  REQUIRE_FALSE(ck.ok());
  CHECK(ck.error().message.find("is not a plain file name") != std::string::npos);
}
