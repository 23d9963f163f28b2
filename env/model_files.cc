#include "env/model_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/hf/safetensors_index.h"
#include "core/manifest.h"
#include "core/strings.h"

namespace spark::env {

ModelFiles read_model_files(const Sysroot& root, const std::string& model_path) {
  ModelFiles m;
  m.dir = model_path;
  auto entries = root.list(model_path);
  m.dir_exists = root.exists(model_path);
  if (!m.dir_exists) {
    m.config_error = "the model directory does not exist";
    return m;
  }

  std::map<std::string, uint64_t> expected;
  if (auto text = root.read(model_path + "/" + kManifestName)) {
    m.has_manifest = true;
    auto man = parse_manifest_json(*text, model_path + "/" + kManifestName);
    if (!man) {
      m.manifest_error = man.error().message;
    } else {
      m.manifest_digest = man->digest();
      for (const auto& f : man->files) expected[f.path] = f.size;
    }
  }
  auto add = [&](const std::string& name) {
    ModelFile f;
    f.name = name;
    f.size = root.file_size(model_path + "/" + name);
    if (auto it = expected.find(name); it != expected.end()) f.expected = it->second;
    m.files.push_back(f);
    return m.files.back();
  };

  add("config.json");
  if (auto text = root.read(model_path + "/config.json")) {
    auto c = hf::parse_config_text(*text, "config.json");
    if (!c) {
      m.config_error = c.error().message;
    } else {
      m.config = std::move(*c);
      m.config_ok = true;
    }
  } else {
    m.config_error = "config.json is missing";
  }

  std::vector<std::string> shards;
  uint64_t index_total = 0;
  if (std::find(entries.begin(), entries.end(), hf::kSafetensorsIndexName) != entries.end()) {
    m.index_name = hf::kSafetensorsIndexName;
    add(m.index_name);
    auto text = root.read(model_path + "/" + m.index_name);
    auto idx = text ? hf::parse_safetensors_index(*text, m.index_name)
                    : Result<hf::SafetensorsIndex>(
                          make_error(Errc::io, fmt::format("{}: cannot read", m.index_name)));
    if (!idx) {
      m.index_error = idx.error().message;
    } else {
      shards = idx->files;
      index_total = idx->total_size.value_or(0);
    }
  } else {
    for (const auto& e : entries)
      if (ends_with(e, ".safetensors")) shards.push_back(e);
    if (shards.empty()) m.index_error = "no model.safetensors.index.json and no *.safetensors file";
  }
  uint64_t sum = 0;
  for (const auto& s : shards) {
    const auto& f = add(s);
    sum += f.size.value_or(0);
  }
  m.weight_bytes = index_total ? index_total : sum;
  return m;
}

}  // namespace spark::env
