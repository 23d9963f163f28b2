#pragma once
// A Hugging Face model directory's weights: one model.safetensors, or shards listed by
// model.safetensors.index.json. Finds each tensor's file, reads slices of it as floats,
// and drops the page cache of every file after loading.
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "daemon/engine/safetensors.h"

namespace spark::engine {

class Checkpoint {
 public:
  /// Opens the weights of model directory `dir` and validates every file's header and,
  /// with an index, that each listed tensor is in its file.
  static Result<Checkpoint> open(const std::string& dir);

  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
  /// Reads `slice` of tensor `name` into dst after checking its shape is `shape` (the
  /// full, unsliced shape the model expects).
  Status read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice,
              float* dst) const;
  /// The tensor `name` after checking that its shape is `shape` (errors as read()).
  Result<const TensorInfo*> lookup(const std::string& name,
                                   const std::vector<int64_t>& shape) const;
  /// Reads `slice` of tensor `name` into dst as stored in the file (no conversion; the
  /// element type is lookup()'s dtype), after the same checks as read().
  Status read_raw(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice,
                  void* dst) const;
  /// Drops the page cache of all weight files (posix_fadvise DONTNEED).
  void drop_page_cache() const;
  /// Notes that a loader is done with tensor `name` and drops the page cache of the run of
  /// finished tensors around it in its file. The run, not the tensor alone: the kernel
  /// keeps a file's cache in large folios (up to megabytes) and drops only the folios a
  /// range covers whole, which a small tensor rarely does.
  void drop_page_cache(const std::string& name) const;
  /// Paths of the weight files.
  std::vector<std::string> files() const;
  /// Names of every tensor, sorted.
  std::vector<std::string> tensor_names() const;
  /// Total bytes of tensor data read so far (for load reports and tests of TP slicing).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, std::pair<size_t, const TensorInfo*>> index_;
  mutable uint64_t bytes_read_ = 0;
  // Per file: the byte ranges of finished tensors, merged where they touch (begin -> end).
  mutable std::vector<std::map<uint64_t, uint64_t>> done_;
};

}  // namespace spark::engine
