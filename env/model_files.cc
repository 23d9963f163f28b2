#include "env/model_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "core/hf/safetensors_index.h"
#include "core/manifest.h"
#include "core/model_plan.h"
#include "core/strings.h"

namespace spark::env {

using nlohmann::json;

namespace {

// Tensor byte counts from one shard's safetensors header: an 8-byte little-endian length,
// then that much JSON of {name: {dtype, shape, data_offsets: [begin, end]}}. Only the byte
// ranges are read here (for sizing); the engine's loader validates the whole header.
Status add_tensor_sizes(const std::string& path, const std::string& where, ModelFiles* m) {
  std::ifstream f(path, std::ios::binary);
  unsigned char len8[8];
  if (!f.read(reinterpret_cast<char*>(len8), 8))
    return make_error(Errc::integrity, where + ": shorter than a safetensors header");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len8[i];
  if (n == 0 || n > (100ull << 20))
    return make_error(Errc::integrity,
                      fmt::format("{}: safetensors header length {} is not plausible", where, n));
  std::string text(n, '\0');
  if (!f.read(text.data(), static_cast<std::streamsize>(n)))
    return make_error(Errc::integrity, where + ": truncated safetensors header");
  json h = json::parse(text, nullptr, false);
  if (!h.is_object()) return make_error(Errc::integrity, where + ": header is not a JSON object");
  for (const auto& [name, t] : h.items()) {
    if (name == "__metadata__") continue;
    const json* off = t.is_object() && t.contains("data_offsets") ? &t["data_offsets"] : nullptr;
    if (!off || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned() || (*off)[1].get<uint64_t>() < (*off)[0].get<uint64_t>())
      return make_error(Errc::integrity,
                        fmt::format("{}: tensor {} has no valid data_offsets", where, name));
    uint64_t b = (*off)[1].get<uint64_t>() - (*off)[0].get<uint64_t>();
    m->tensor_bytes += b;
    if (auto dt = t.find("dtype"); dt != t.end() && dt->is_string()) {
      auto& seen = m->tensor_dtypes[dt->get<std::string>()];
      if (seen.tensors++ == 0) seen.example = name;
    }
    if (plan::is_routed_expert_tensor(name)) m->expert_bytes += b;
  }
  return Status::Ok();
}

}  // namespace

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
  m.tokenizer_json = root.file_size(model_path + "/tokenizer.json").has_value();
  if (auto text = root.read(model_path + "/config.json", kJsonReadCap)) {
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
    auto text = root.read(model_path + "/" + m.index_name, kJsonReadCap);
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
  m.tensor_sizes = !shards.empty();
  for (const auto& sh : shards) {
    auto st = add_tensor_sizes(root.path(model_path + "/" + sh), model_path + "/" + sh, &m);
    if (!st.ok()) {
      m.tensor_sizes = false;
      m.tensor_sizes_error = st.message();
      m.tensor_bytes = m.expert_bytes = 0;
      m.tensor_dtypes.clear();
      break;
    }
  }
  return m;
}

}  // namespace spark::env
