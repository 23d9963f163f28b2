#include "daemon/engine/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"

namespace spark::engine {

namespace fs = std::filesystem;

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::vector<std::string> names;
  nlohmann::json weight_map;
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    auto text = read_file(index_path);
    if (!text) return make_error(Errc::io, fmt::format("{}: cannot read", index_path));
    auto j = nlohmann::json::parse(*text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object())
      return make_error(
          Errc::integrity,
          fmt::format("{}: not a safetensors index (needs a \"weight_map\" object)", index_path));
    weight_map = j["weight_map"];
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      if (!it.value().is_string())
        return make_error(Errc::integrity, fmt::format("{}: weight_map[\"{}\"] is not a file name",
                                                       index_path, it.key()));
      const auto& f = it.value().get_ref<const std::string&>();
      if (f.find('/') != std::string::npos || f == ".." || f.empty())
        return make_error(Errc::integrity,
                          fmt::format("{}: weight_map[\"{}\"] = \"{}\" is not a plain file name",
                                      index_path, it.key(), f));
      if (std::find(names.begin(), names.end(), f) == names.end()) names.push_back(f);
    }
  } else if (fs::exists(dir + "/model.safetensors", ec)) {
    names.push_back("model.safetensors");
  } else {
    return make_error(
        Errc::not_found,
        fmt::format("{}: no model.safetensors or model.safetensors.index.json — is this a "
                    "Hugging Face model directory with safetensors weights?",
                    dir));
  }
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    auto f = SafetensorsFile::open(dir + "/" + n);
    if (!f) return f.error();
    c.files_.push_back(std::make_unique<SafetensorsFile>(std::move(*f)));
  }
  for (size_t i = 0; i < c.files_.size(); ++i) {
    for (const auto& t : c.files_[i]->header().tensors) {
      if (!weight_map.is_null()) {
        auto w = weight_map.find(t.name);
        if (w == weight_map.end() || w->get<std::string>() != names[i])
          continue;  // listed elsewhere
      }
      if (c.index_.count(t.name))
        return make_error(Errc::integrity,
                          fmt::format("{}: tensor \"{}\" appears in two files", dir, t.name));
      c.index_[t.name] = {i, &t};
    }
  }
  if (!weight_map.is_null()) {
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it)
      if (!c.index_.count(it.key()))
        return make_error(
            Errc::integrity,
            fmt::format("{}: index lists tensor \"{}\" in {} but that file does not have it",
                        index_path, it.key(), it.value().get<std::string>()));
  }
  return c;
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second.second;
}

Result<const TensorInfo*> Checkpoint::lookup(const std::string& name,
                                             const std::vector<int64_t>& shape) const {
  auto it = index_.find(name);
  if (it == index_.end())
    return make_error(
        Errc::not_found,
        fmt::format("{}: tensor \"{}\" is missing from the checkpoint — the files do not "
                    "match config.json's architecture",
                    dir_, name));
  const TensorInfo& t = *it->second.second;
  if (t.shape != shape) {
    auto fmt_shape = [](const std::vector<int64_t>& s) {
      return fmt::format("[{}]", fmt::join(s, ", "));
    };
    return make_error(
        Errc::integrity,
        fmt::format("{}: tensor \"{}\" has shape {} but config.json implies {}",
                    files_[it->second.first]->path(), name, fmt_shape(t.shape), fmt_shape(shape)));
  }
  return &t;
}

Status Checkpoint::read(const std::string& name, const std::vector<int64_t>& shape,
                        const Slice& slice, float* dst) const {
  auto t = lookup(name, shape);
  if (!t) return t.error();
  SPARK_TRY(files_[index_.at(name).first]->read(**t, slice, dst));
  const int64_t rows = slice.rows < 0 ? (*t)->rows() - slice.row0 : slice.rows;
  const int64_t cols = slice.cols < 0 ? (*t)->cols() - slice.col0 : slice.cols;
  bytes_read_ += static_cast<uint64_t>(rows * cols) * dtype_size((*t)->dtype);
  return Status::Ok();
}

Status Checkpoint::read_raw(const std::string& name, const std::vector<int64_t>& shape,
                            const Slice& slice, void* dst) const {
  auto t = lookup(name, shape);
  if (!t) return t.error();
  SPARK_TRY(files_[index_.at(name).first]->read_raw(**t, slice, dst));
  const int64_t rows = slice.rows < 0 ? (*t)->rows() - slice.row0 : slice.rows;
  const int64_t cols = slice.cols < 0 ? (*t)->cols() - slice.col0 : slice.cols;
  bytes_read_ += static_cast<uint64_t>(rows * cols) * dtype_size((*t)->dtype);
  return Status::Ok();
}

void Checkpoint::drop_page_cache() const {
  for (const auto& f : files_) f->drop_page_cache();
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path());
  return out;
}

}  // namespace spark::engine
