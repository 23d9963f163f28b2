#include "env/model_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/manifest.h"
#include "core/strings.h"

namespace spark::env {

using nlohmann::json;

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
  if (auto text = root.read(model_path + "/" + kManifestName, kJsonReadCap)) {
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
  if (auto text = root.read(model_path + "/config.json", kJsonReadCap)) {
    m.config = json::parse(*text, nullptr, false);
    if (m.config.is_discarded() || !m.config.is_object())
      m.config_error = "config.json is not a JSON object";
    else
      m.config_ok = true;
  } else {
    m.config_error = "config.json is missing";
  }

  std::vector<std::string> shards;
  uint64_t index_total = 0;
  if (std::find(entries.begin(), entries.end(), "model.safetensors.index.json") != entries.end()) {
    m.index_name = "model.safetensors.index.json";
    add(m.index_name);
    auto text = root.read(model_path + "/" + m.index_name, kJsonReadCap);
    json j = text ? json::parse(*text, nullptr, false) : json();
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      m.index_error = fmt::format("{} has no weight_map", m.index_name);
    } else {
      std::set<std::string> names;
      for (const auto& [tensor, file] : j["weight_map"].items())
        if (file.is_string()) names.insert(file.get<std::string>());
      shards.assign(names.begin(), names.end());
      if (j.contains("metadata") && j["metadata"].is_object() &&
          j["metadata"].contains("total_size") && j["metadata"]["total_size"].is_number())
        index_total = j["metadata"]["total_size"].get<uint64_t>();
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
