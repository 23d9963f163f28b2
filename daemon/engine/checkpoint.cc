#include "daemon/engine/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "core/hf/safetensors_index.h"
#include "core/strings.h"

namespace spark::engine {

namespace fs = std::filesystem;

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  const std::string index_path = dir + "/" + hf::kSafetensorsIndexName;
  std::optional<hf::SafetensorsIndex> index;
  std::vector<std::string> names;
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    auto text = read_file(index_path);
    if (!text) return make_error(Errc::io, fmt::format("{}: cannot read", index_path));
    auto idx = hf::parse_safetensors_index(*text, index_path);
    if (!idx) return idx.error();
    index = std::move(*idx);
    names = index->files;
  } else if (fs::exists(dir + "/model.safetensors", ec)) {
    names.push_back("model.safetensors");
  } else {
    return make_error(
        Errc::not_found,
        fmt::format("{}: no model.safetensors or model.safetensors.index.json — is this a "
                    "Hugging Face model directory with safetensors weights?",
                    dir));
  }
  for (const auto& n : names) {
    auto f = SafetensorsFile::open(dir + "/" + n);
    if (!f) return f.error();
    c.files_.push_back(std::make_unique<SafetensorsFile>(std::move(*f)));
  }
  for (size_t i = 0; i < c.files_.size(); ++i) {
    for (const auto& t : c.files_[i]->header().tensors) {
      if (index) {
        auto w = index->weight_map.find(t.name);
        if (w == index->weight_map.end() || w->second != names[i]) continue;  // listed elsewhere
      }
      if (c.index_.count(t.name))
        return make_error(Errc::integrity,
                          fmt::format("{}: tensor \"{}\" appears in two files", dir, t.name));
      c.index_[t.name] = {i, &t};
    }
  }
  if (index) {
    for (const auto& [tensor, file] : index->weight_map)
      if (!c.index_.count(tensor))
        return make_error(
            Errc::integrity,
            fmt::format("{}: index lists tensor \"{}\" in {} but that file does not have it",
                        index_path, tensor, file));
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

void Checkpoint::drop_page_cache(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return;
  if (done_.size() != files_.size()) {
    done_.assign(files_.size(), {});
    for (size_t i = 0; i < files_.size(); ++i)  // the header was read at open()
      done_[i][0] = files_[i]->header().data_start;
  }
  auto& runs = done_[it->second.first];
  uint64_t b = it->second.second->begin, e = it->second.second->end;
  // Merge with the runs that touch [b, e): safetensors data is contiguous, so the finished
  // tensors of a file coalesce into a few long runs.
  auto next = runs.lower_bound(b);
  if (next != runs.begin()) {
    auto prev = std::prev(next);
    if (prev->second >= b) {
      b = prev->first;
      e = std::max(e, prev->second);
      next = runs.erase(prev);
    }
  }
  while (next != runs.end() && next->first <= e) {
    e = std::max(e, next->second);
    next = runs.erase(next);
  }
  runs[b] = e;
  TensorInfo run;
  run.begin = b;
  run.end = e;
  files_[it->second.first]->drop_page_cache(run);
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, at] : index_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Checkpoint::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path());
  return out;
}

}  // namespace spark::engine
