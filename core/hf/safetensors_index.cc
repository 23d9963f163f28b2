#include "core/hf/safetensors_index.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <set>

namespace spark::hf {

Result<SafetensorsIndex> parse_safetensors_index(const std::string& text,
                                                 const std::string& where) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
      !j["weight_map"].is_object())
    return make_error(
        Errc::integrity,
        fmt::format("{}: not a safetensors index (needs a \"weight_map\" object)", where));
  SafetensorsIndex idx;
  std::set<std::string> files;
  for (const auto& [tensor, file] : j["weight_map"].items()) {
    if (!file.is_string())
      return make_error(Errc::integrity,
                        fmt::format("{}: weight_map[\"{}\"] is not a file name", where, tensor));
    const auto& f = file.get_ref<const std::string&>();
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos)
      return make_error(Errc::integrity,
                        fmt::format("{}: weight_map[\"{}\"] = \"{}\" is not a plain file name",
                                    where, tensor, f));
    idx.weight_map.emplace(tensor, f);
    files.insert(f);
  }
  idx.files.assign(files.begin(), files.end());
  if (auto m = j.find("metadata"); m != j.end() && m->is_object())
    if (auto t = m->find("total_size"); t != m->end() && t->is_number() && t->get<double>() >= 0)
      idx.total_size = t->get<uint64_t>();
  return idx;
}

}  // namespace spark::hf
