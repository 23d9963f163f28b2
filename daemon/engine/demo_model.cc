#include "daemon/engine/demo_model.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/family.h"
#include "daemon/engine/random_checkpoint.h"

namespace spark::engine {

// Generated from daemon/engine/demo/ at configure time (nullptr would mean no tokenizer).
extern const char* const kDemo_tokenizer_json;
extern const char* const kDemo_tokenizer_config_json;

namespace fs = std::filesystem;

namespace {

constexpr const char* kDemoMarker = "sparkctl_demo";

ModelConfig demo_config(Family family) {
  ModelConfig c = small_config(family, 2688, 256, 4);  // vocab covers the fixture's 2647 ids
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.intermediate_size = 512;
  if (c.is_moe()) {  // 8 experts of 128, 2 a token (GLM's 4 groups keep 2)
    c.moe.expert_inter = 128;
    if (c.moe.shared_inter > 0) c.moe.shared_inter = 128;
    if (family == Family::mixtral || family == Family::minimax_m2 || family == Family::gpt_oss)
      c.intermediate_size = c.moe.expert_inter;
  }
  if (c.is_mla()) {  // latent attention: every head reads the latent; q/k are nope + rope
    c.num_kv_heads = c.num_heads;
    c.head_dim = c.mla.qk_head_dim();
  }
  c.max_position = 2048;
  if (c.rope.type == "yarn" && c.is_mla()) c.rope.original_max_position = 2048 / c.rope.factor;
  c.rope_theta = 1000000.0;
  c.rms_eps = 1e-6;
  c.tie_word_embeddings = true;
  c.bos_token_id = -1;
  c.eos_token_ids = {2639, 2637};  // <|im_end|>, <|endoftext|> in the tokenizer fixture
  return c;
}

bool is_earlier_demo(const fs::path& dir) {
  auto text = read_file((dir / "config.json").string());
  if (!text) return false;
  auto j = nlohmann::json::parse(*text, nullptr, false);
  return !j.is_discarded() && j.is_object() && j.value(kDemoMarker, false);
}

}  // namespace

Result<DemoModelReport> write_demo_model(const std::string& dir_str, bool force,
                                         const std::string& architecture,
                                         const std::string& weights) {
  if (!weights.empty() && weights != "bf16" && weights != "fp8")
    return make_error(Errc::usage,
                      fmt::format("demo-model --weights {}: one of bf16, fp8", weights));
  Family family = Family::qwen2;
  if (!architecture.empty()) {
    bool found = false;
    for (const auto& f : family_table())
      if (architecture == f.architecture || architecture == f.model_type) {
        family = f.family;
        found = true;
      }
    if (!found)
      return make_error(Errc::usage,
                        fmt::format("demo-model --arch {}: not an architecture the engine runs "
                                    "(one of {})",
                                    architecture, supported_architectures()));
  }
  const fs::path dir = fs::absolute(dir_str);
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      return make_error(Errc::usage, fmt::format("{} exists and is not a directory", dir.string()));
    if (!fs::is_empty(dir, ec) && !is_earlier_demo(dir) && !force)
      return make_error(
          Errc::precondition,
          fmt::format(
              "{} is not empty and holds no earlier demo model — choose an empty directory or "
              "pass --force to replace its contents",
              dir.string()));
  }
  const fs::path tmp =
      dir.parent_path() / fmt::format(".{}.tmp.{}", dir.filename().string(), ::getpid());
  fs::remove_all(tmp, ec);
  DemoModelReport rep;
  rep.dir = dir.string();
  const ModelConfig c = demo_config(family);
  rep.architecture = c.architecture;
  auto cleanup = [&] { fs::remove_all(tmp, ec); };
  RandomCheckpointSpec spec{c, DType::bf16, 20261129, 1};
  spec.fp8 = weights == "fp8";
  if (auto st = write_random_checkpoint(tmp.string(), spec); !st.ok()) {
    cleanup();
    return st.error();
  }
  // Mark it as ours and record what it is.
  {
    auto text = read_file((tmp / "config.json").string());
    auto j = nlohmann::json::parse(*text);
    j[kDemoMarker] = true;
    j["bos_token_id"] = nullptr;
    std::string why;
    if (!write_file_atomic((tmp / "config.json").string(), j.dump(2) + "\n", &why)) {
      cleanup();
      return make_error(Errc::io, fmt::format("{}: {}", (tmp / "config.json").string(), why));
    }
  }
  if (kDemo_tokenizer_json && kDemo_tokenizer_config_json) {
    std::string why;
    if (!write_file_atomic((tmp / "tokenizer.json").string(), kDemo_tokenizer_json, &why) ||
        !write_file_atomic((tmp / "tokenizer_config.json").string(), kDemo_tokenizer_config_json,
                           &why)) {
      cleanup();
      return make_error(Errc::io, fmt::format("{}: writing the tokenizer: {}", tmp.string(), why));
    }
    rep.tokenizer = true;
  } else {
    rep.note =
        "this sparkctl was built without the demo tokenizer (daemon/engine/demo/); the "
        "checkpoint has "
        "no tokenizer.json, so only token-id requests work";
  }
  const std::string readme =
      "This is sparkctl's demo model: a small " + c.architecture +
      " with RANDOM weights.\n"
      "It is not trained; it answers with nonsense. It exists so that a ring can be started and\n"
      "a chat request answered on a machine without a GPU. Written by `sparkctl demo-model`.\n";
  std::string why;
  if (!write_file_atomic((tmp / "README.md").string(), readme, &why)) {
    cleanup();
    return make_error(Errc::io, why);
  }
  // Swap into place.
  if (fs::exists(dir, ec)) fs::remove_all(dir, ec);
  if (ec) {
    cleanup();
    return make_error(Errc::io, fmt::format("{}: cannot replace: {}", dir.string(), ec.message()));
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    cleanup();
    return make_error(Errc::io, fmt::format("{}: cannot move the demo model into place: {}",
                                            dir.string(), ec.message()));
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    rep.files.push_back(e.path().filename().string());
    rep.bytes += fs::file_size(e.path());
  }
  std::sort(rep.files.begin(), rep.files.end());
  rep.parameters = count_params(c).total;
  return rep;
}

}  // namespace spark::engine
