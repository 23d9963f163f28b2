#include "daemon/engine/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

namespace spark::engine {
namespace {

struct DTypeEntry {
  const char* name;
  DType dtype;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {"F32", DType::f32, 4},      {"F16", DType::f16, 2},         {"BF16", DType::bf16, 2},
    {"F64", DType::f64, 8},      {"I64", DType::i64, 8},         {"I32", DType::i32, 4},
    {"I16", DType::i16, 2},      {"I8", DType::i8, 1},           {"U8", DType::u8, 1},
    {"BOOL", DType::boolean, 1}, {"F8_E4M3", DType::f8_e4m3, 1}, {"F8_E5M2", DType::f8_e5m2, 1},
};

// nlohmann's DOM teardown recurses; refuse absurd nesting before parsing.
bool nesting_ok(std::string_view s, int limit) {
  int depth = 0;
  bool in_str = false, esc = false;
  for (char c : s) {
    if (in_str) {
      if (esc)
        esc = false;
      else if (c == '\\')
        esc = true;
      else if (c == '"')
        in_str = false;
      continue;
    }
    if (c == '"')
      in_str = true;
    else if (c == '{' || c == '[') {
      if (++depth > limit) return false;
    } else if (c == '}' || c == ']')
      --depth;
  }
  return true;
}

Error bad(const std::string& where, const std::string& what) {
  return make_error(Errc::integrity,
                    fmt::format("{}: invalid safetensors header: {} — the file is damaged or not "
                                "a safetensors file; download it again",
                                where, what));
}

Status pread_all(int fd, void* dst, size_t n, uint64_t off, const std::string& where) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return make_error(Errc::io, fmt::format("{}: read at offset {} failed: {}", where, off,
                                              std::strerror(errno)));
    }
    if (r == 0)
      return make_error(
          Errc::io,
          fmt::format("{}: unexpected end of file at offset {} (truncated?)", where, off));
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

void convert(DType d, const char* src, float* dst, size_t n) {
  switch (d) {
    case DType::f32:
      std::memcpy(dst, src, n * 4);
      break;
    case DType::bf16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        dst[i] = bf16_to_float(v);
      }
      break;
    case DType::f16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        dst[i] = f16_to_float(v);
      }
      break;
    default:
      break;
  }
}

}  // namespace

size_t dtype_size(DType d) {
  for (const auto& e : kDTypes)
    if (e.dtype == d) return e.size;
  return 0;
}

const char* dtype_name(DType d) {
  for (const auto& e : kDTypes)
    if (e.dtype == d) return e.name;
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

bool dtype_loadable(DType d) {
  return d == DType::f32 || d == DType::bf16 || d == DType::f16;
}

const char* loadable_dtype_names() {
  return "F32, BF16 and F16";
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}
int64_t TensorInfo::rows() const {
  return shape.empty() ? 1 : shape[0];
}
int64_t TensorInfo::cols() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

Result<SafetensorsHeader> parse_safetensors_header(std::string_view prefix, uint64_t file_size,
                                                   const std::string& where) {
  if (prefix.size() < 8 || file_size < 8)
    return bad(where,
               fmt::format("file is {} bytes, shorter than the 8-byte length prefix", file_size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(prefix[static_cast<size_t>(i)]);
  if (n < 2) return bad(where, fmt::format("header length {} is too small", n));
  if (n > kMaxHeaderBytes)
    return bad(where,
               fmt::format("header length {} exceeds the {} byte limit", n, kMaxHeaderBytes));
  if (n > file_size - 8)
    return bad(where,
               fmt::format("header length {} runs past the end of the {}-byte file", n, file_size));
  if (prefix.size() < 8 + n)
    return bad(where, fmt::format("only {} of {} header bytes available", prefix.size() - 8, n));
  std::string_view js = prefix.substr(8, n);
  if (!nesting_ok(js, 8)) return bad(where, "JSON nested too deeply");
  nlohmann::json j = nlohmann::json::parse(js.begin(), js.end(), nullptr, false);
  if (j.is_discarded()) return bad(where, "header is not valid JSON");
  if (!j.is_object()) return bad(where, "header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return bad(where, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return bad(where, fmt::format("__metadata__[\"{}\"] is not a string", m.key()));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return bad(where, fmt::format("entry \"{}\" is not an object", name));
    TensorInfo t;
    t.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string())
      return bad(where, fmt::format("tensor \"{}\" has no dtype string", name));
    const auto& dts = dt->get_ref<const std::string&>();
    bool known = false;
    size_t esize = 0;
    for (const auto& e : kDTypes)
      if (dts == e.name) {
        t.dtype = e.dtype;
        esize = e.size;
        known = true;
      }
    if (!known) return bad(where, fmt::format("tensor \"{}\" has unknown dtype \"{}\"", name, dts));
    auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array())
      return bad(where, fmt::format("tensor \"{}\" has no shape array", name));
    if (sh->size() > 8)
      return bad(where, fmt::format("tensor \"{}\" has {} dimensions", name, sh->size()));
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned())
        return bad(where,
                   fmt::format("tensor \"{}\" has a non-integer or negative dimension", name));
      uint64_t dim = d.get<uint64_t>();
      if (dim > (1ull << 40) || (dim != 0 && numel > (1ull << 46) / dim))
        return bad(where, fmt::format("tensor \"{}\" shape is too large", name));
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      return bad(where, fmt::format("tensor \"{}\" needs data_offsets [begin, end]", name));
    uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e)
      return bad(where,
                 fmt::format("tensor \"{}\" data_offsets [{}, {}] are reversed", name, b, e));
    if (e > data_size)
      return bad(where,
                 fmt::format("tensor \"{}\" ends at data offset {}, past the {}-byte data section",
                             name, e, data_size));
    if (e - b != numel * esize)
      return bad(where, fmt::format(
                            "tensor \"{}\" is {} {} x {} bytes = {} bytes but data_offsets span {}",
                            name, numel, dts, esize, numel * esize, e - b));
    t.begin = h.data_start + b;
    t.end = h.data_start + e;
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    const auto& p = h.tensors[i - 1];
    const auto& c = h.tensors[i];
    if (c.begin < p.end)
      return bad(where, fmt::format("tensors \"{}\" and \"{}\" overlap", p.name, c.name));
  }
  return h;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept {
  *this = std::move(o);
}
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    size_ = o.size_;
    header_ = std::move(o.header_);
    o.fd_ = -1;
  }
  return *this;
}
SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd_ < 0)
    return make_error(errno == ENOENT ? Errc::not_found : Errc::io,
                      fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(f.fd_, &st) != 0 || !S_ISREG(st.st_mode))
    return make_error(Errc::io, fmt::format("{}: not a regular file", path));
  f.size_ = static_cast<uint64_t>(st.st_size);
  std::string buf(8, '\0');
  if (f.size_ < 8)
    return bad(path,
               fmt::format("file is {} bytes, shorter than the 8-byte length prefix", f.size_));
  SPARK_TRY(pread_all(f.fd_, buf.data(), 8, 0, path));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
  if (n > kMaxHeaderBytes || n > f.size_ - 8)
    return bad(path, fmt::format("header length {} does not fit the {}-byte file", n, f.size_));
  buf.resize(8 + n);
  SPARK_TRY(pread_all(f.fd_, buf.data() + 8, n, 8, path));
  auto h = parse_safetensors_header(buf, f.size_, path);
  if (!h) return h.error();
  f.header_ = std::move(*h);
  return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  for (const auto& t : header_.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Status SafetensorsFile::read_raw(const TensorInfo& t, const Slice& s, void* dst) const {
  const int64_t R = t.rows(), C = t.cols();
  const int64_t rows = s.rows < 0 ? R - s.row0 : s.rows;
  const int64_t cols = s.cols < 0 ? C - s.col0 : s.cols;
  if (s.row0 < 0 || s.col0 < 0 || rows < 0 || cols < 0 || s.row0 + rows > R || s.col0 + cols > C)
    return make_error(
        Errc::internal,
        fmt::format("{}: slice rows [{}, +{}) cols [{}, +{}) outside tensor \"{}\" ({} x {})",
                    path_, s.row0, rows, s.col0, cols, t.name, R, C));
  const size_t es = dtype_size(t.dtype);
  if (rows == 0 || cols == 0) return Status::Ok();
  auto* out = static_cast<char*>(dst);
  if (cols == C)
    return pread_all(fd_, out, static_cast<size_t>(rows * C) * es,
                     t.begin + static_cast<uint64_t>(s.row0 * C) * es, path_);
  const size_t row_bytes = static_cast<size_t>(cols) * es;
  for (int64_t r = 0; r < rows; ++r)
    SPARK_TRY(pread_all(fd_, out + static_cast<size_t>(r) * row_bytes, row_bytes,
                        t.begin + static_cast<uint64_t>((s.row0 + r) * C + s.col0) * es, path_));
  return Status::Ok();
}

Status SafetensorsFile::read(const TensorInfo& t, const Slice& s, float* dst) const {
  if (!dtype_loadable(t.dtype))
    return make_error(Errc::unsupported,
                      fmt::format("{}: tensor \"{}\" is {}; only {} can be loaded", path_, t.name,
                                  dtype_name(t.dtype), loadable_dtype_names()));
  const int64_t R = t.rows(), C = t.cols();
  const int64_t rows = s.rows < 0 ? R - s.row0 : s.rows;
  const int64_t cols = s.cols < 0 ? C - s.col0 : s.cols;
  if (s.row0 < 0 || s.col0 < 0 || rows < 0 || cols < 0 || s.row0 + rows > R || s.col0 + cols > C)
    return make_error(
        Errc::internal,
        fmt::format("{}: slice rows [{}, +{}) cols [{}, +{}) outside tensor \"{}\" ({} x {})",
                    path_, s.row0, rows, s.col0, cols, t.name, R, C));
  const size_t es = dtype_size(t.dtype);
  if (rows == 0 || cols == 0) return Status::Ok();
  if (cols == C) {
    // Whole rows: one contiguous range, read in chunks.
    const uint64_t off = t.begin + static_cast<uint64_t>(s.row0 * C) * es;
    const size_t total = static_cast<size_t>(rows * C);
    if (t.dtype == DType::f32) return pread_all(fd_, dst, total * 4, off, path_);
    constexpr size_t kChunk = 1 << 20;  // elements per bounce read
    std::vector<char> bounce(std::min(total, kChunk) * es);
    for (size_t done = 0; done < total;) {
      size_t n = std::min(kChunk, total - done);
      SPARK_TRY(pread_all(fd_, bounce.data(), n * es, off + done * es, path_));
      convert(t.dtype, bounce.data(), dst + done, n);
      done += n;
    }
    return Status::Ok();
  }
  // Column slice: one read per row segment.
  std::vector<char> bounce(static_cast<size_t>(cols) * es);
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t off = t.begin + static_cast<uint64_t>((s.row0 + r) * C + s.col0) * es;
    float* out = dst + r * cols;
    if (t.dtype == DType::f32) {
      SPARK_TRY(pread_all(fd_, out, static_cast<size_t>(cols) * 4, off, path_));
    } else {
      SPARK_TRY(pread_all(fd_, bounce.data(), bounce.size(), off, path_));
      convert(t.dtype, bounce.data(), out, static_cast<size_t>(cols));
    }
  }
  return Status::Ok();
}

void SafetensorsFile::drop_page_cache() const {
  if (fd_ >= 0) (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
}

void SafetensorsFile::drop_page_cache(const TensorInfo& t) const {
  if (fd_ >= 0 && t.end > t.begin)
    (void)::posix_fadvise(fd_, static_cast<off_t>(t.begin), static_cast<off_t>(t.end - t.begin),
                          POSIX_FADV_DONTNEED);
}

Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                         DType dtype, const std::map<std::string, std::string>& metadata) {
  if (dtype != DType::f32 && dtype != DType::bf16)
    return make_error(Errc::unsupported, "write_safetensors: only F32 and BF16 are written");
  const size_t es = dtype_size(dtype);
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (auto d : t.shape) n *= static_cast<uint64_t>(d);
    const DType dt = t.raw ? t.raw_dtype : dtype;
    const size_t tes = t.raw ? dtype_size(dt) : es;
    h[t.name] = {
        {"dtype", dtype_name(dt)}, {"shape", t.shape}, {"data_offsets", {off, off + n * tes}}};
    off += n * tes;
  }
  std::string js = h.dump();
  while ((8 + js.size()) % 8 != 0) js.push_back(' ');  // align the data section
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return make_error(Errc::io, fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  std::string out;
  out.reserve(8 + js.size() + off);
  uint64_t n = js.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += js;
  for (const auto& t : tensors) {
    size_t cnt = 1;
    for (auto d : t.shape) cnt *= static_cast<size_t>(d);
    if (t.raw) {
      out.append(static_cast<const char*>(t.raw), cnt * dtype_size(t.raw_dtype));
    } else if (dtype == DType::f32) {
      out.append(reinterpret_cast<const char*>(t.data), cnt * 4);
    } else {
      for (size_t i = 0; i < cnt; ++i) {
        uint16_t b = float_to_bf16(t.data[i]);
        out.append(reinterpret_cast<const char*>(&b), 2);
      }
    }
  }
  const char* p = out.data();
  size_t left = out.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return make_error(Errc::io, fmt::format("{}: write failed: {}", tmp, std::strerror(e)));
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return make_error(Errc::io,
                      fmt::format("{}: fsync/close failed: {}", tmp, std::strerror(errno)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return make_error(Errc::io, fmt::format("{}: rename failed: {}", path, std::strerror(errno)));
  }
  return Status::Ok();
}

}  // namespace spark::engine
