#pragma once
// Our own safetensors reader. The header is validated before any tensor is trusted: JSON
// length inside the file, known dtypes, shapes whose byte count matches the data offsets,
// offsets inside the data section and no two tensors overlapping. Tensors are read with
// pread straight into the caller's float buffer (BF16/F16 converted through a small bounce
// buffer), never mmap-then-copy, so peak memory stays near the size of the weights; a
// tensor-parallel rank reads only its row/column slice.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark::engine {

/// Element types of a safetensors file. Only f32/f16/bf16 can be loaded as floats; the
/// others are recognised so that the header validates, and refused when read.
enum class DType { f32, f16, bf16, f64, i64, i32, i16, i8, u8, boolean, f8_e4m3, f8_e5m2 };

/// Bytes per element of a dtype.
size_t dtype_size(DType d);
/// The safetensors spelling ("F32", "BF16", ...).
const char* dtype_name(DType d);
/// The dtype a safetensors spelling names; nullopt for one the reader does not know.
std::optional<DType> dtype_from_name(std::string_view name);
/// Whether the engine loads tensors of this type (F32, BF16, F16); the others are refused.
bool dtype_loadable(DType d);
/// The loadable types, for messages: "F32, BF16 and F16".
const char* loadable_dtype_names();

/// One tensor of a safetensors file; `begin`/`end` are absolute byte offsets in the file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  /// Number of elements (product of the shape; 1 for a scalar).
  int64_t numel() const;
  /// Rows/columns when viewed as a matrix: rows = shape[0], cols = product of the rest
  /// (a 1-D tensor is rows x 1, a scalar 1 x 1).
  int64_t rows() const;
  int64_t cols() const;
};

/// A parsed and validated header.
struct SafetensorsHeader {
  uint64_t data_start = 0;                      // 8 + header length
  std::vector<TensorInfo> tensors;              // sorted by begin offset
  std::map<std::string, std::string> metadata;  // __metadata__ (string values only)
};

/// Largest JSON header we accept (the format's own reference limit is 100 MB).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

/// Validates and parses the first bytes of a safetensors file. `prefix` holds at least the
/// 8-byte length and the JSON header; `file_size` is the whole file's size. `where` names
/// the file in messages.
Result<SafetensorsHeader> parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                                   const std::string& where);

/// A rectangular slice of a tensor viewed as rows x cols (see TensorInfo::rows()).
struct Slice {
  int64_t row0 = 0, rows = -1;  // rows = -1: all rows from row0
  int64_t col0 = 0, cols = -1;  // cols = -1: all columns from col0
};

/// An open, validated safetensors file.
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  /// Opens `path` and validates its header.
  static Result<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;

  /// Reads `slice` of tensor `t` into `dst` (row-major, slice.rows x slice.cols floats),
  /// converting BF16/F16 to float. Bytes outside the slice are not read.
  Status read(const TensorInfo& t, const Slice& slice, float* dst) const;
  /// Reads `slice` of tensor `t` into `dst` as stored (slice.rows x slice.cols elements of
  /// dtype_size(t.dtype) bytes, no conversion), for loaders that convert elsewhere.
  Status read_raw(const TensorInfo& t, const Slice& slice, void* dst) const;

  /// Drops this file's pages from the page cache (posix_fadvise DONTNEED).
  void drop_page_cache() const;
  /// Drops the pages of [t.begin, t.end) (the folios wholly inside it).
  void drop_page_cache(const TensorInfo& t) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  SafetensorsHeader header_;
};

/// BF16 / F16 bit patterns to float.
float bf16_to_float(uint16_t v);
float f16_to_float(uint16_t v);
/// Round-to-nearest-even float to BF16 (used when writing checkpoints).
uint16_t float_to_bf16(float f);

/// Serialises named tensors as a safetensors file (for demo checkpoints and tests): floats
/// as F32 or BF16 (`dtype`), raw tensors as their own type; written to a temporary name and
/// renamed into place.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // numel floats
  /// Instead of `data`: numel elements already in `raw_dtype` (F8_E4M3 weights), as stored.
  const void* raw = nullptr;
  DType raw_dtype = DType::u8;
};
Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                         DType dtype, const std::map<std::string, std::string>& metadata = {});

}  // namespace spark::engine
