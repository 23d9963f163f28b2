#include "core/manifest.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "core/strings.h"

namespace spark {
namespace {

namespace fs = std::filesystem;
constexpr size_t kReadSize = 8u << 20;  // large sequential reads
constexpr size_t kMaxFiles = 1u << 20;

std::string hash_hex(XXH128_hash_t h) {
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

bool is_hex(const std::string& s, size_t n) {
  if (s.size() != n) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool reserved_name(std::string_view base) {
  return base == kManifestName || ends_with(base, kPartialSuffix) ||
         ends_with(base, kJournalSuffix) || starts_with(base, std::string(kManifestName) + ".tmp");
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

struct EvpFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

}  // namespace

std::string xxh3_hex(const void* data, size_t n) {
  return hash_hex(XXH3_128bits(data, n));
}

std::string Manifest::digest() const {
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  std::string head = std::string(kManifestFormat) + "\n";
  XXH3_128bits_update(st, head.data(), head.size());
  for (const auto& f : files) {
    std::string line = fmt::format("{}\t{}\t{}\n", f.path, f.size, f.xxh3);
    XXH3_128bits_update(st, line.data(), line.size());
  }
  auto h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return hash_hex(h);
}

uint64_t Manifest::total_bytes() const {
  uint64_t t = 0;
  for (const auto& f : files) t += f.size;
  return t;
}

Status check_manifest_path(const std::string& name) {
  auto bad = [&](const char* why) {
    return make_error(Errc::integrity,
                      fmt::format("manifest names '{}': {}; a manifest may only name files "
                                  "inside the model directory (regenerate it with sparkctl "
                                  "manifest DIR)",
                                  name, why));
  };
  if (name.empty()) return bad("empty name");
  if (name.size() > 4096) return bad("name longer than 4096 bytes");
  if (name[0] == '/') return bad("absolute path");
  for (unsigned char c : name) {
    if (c == 0 || c < 0x20 || c == 0x7f) return bad("control character in name");
    if (c == '\\') return bad("backslash in name");
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string::npos) end = name.size();
    std::string_view comp(name.data() + start, end - start);
    if (comp.empty()) return bad("empty path component");
    if (comp == "..") return bad("'..' component escapes the directory");
    if (comp == ".") return bad("'.' component");
    if (comp.size() > 255) return bad("component longer than 255 bytes");
    if (end == name.size() && reserved_name(comp)) return bad("reserved sparkctl file name");
    start = end + 1;
  }
  return {};
}

Result<FileHashes> hash_file(const std::string& path, uint64_t chunk_size, bool sha256) {
  if (chunk_size == 0) return make_error(Errc::internal, "hash_file: chunk size 0");
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return make_error(errno == ENOENT ? Errc::not_found : Errc::io,
                      fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  FdCloser closer{fd};
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<char[]> buf(new char[kReadSize]);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> whole(XXH3_createState(),
                                                                 &XXH3_freeState);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> chunk(XXH3_createState(),
                                                                 &XXH3_freeState);
  XXH3_128bits_reset(whole.get());
  XXH3_128bits_reset(chunk.get());
  std::unique_ptr<EVP_MD_CTX, EvpFree> sha;
  if (sha256) {
    sha.reset(EVP_MD_CTX_new());
    if (!sha || EVP_DigestInit_ex(sha.get(), EVP_sha256(), nullptr) != 1)
      return make_error(Errc::internal, "OpenSSL: cannot start sha256");
  }
  FileHashes out;
  uint64_t in_chunk = 0;
  uint64_t off = 0;
  for (;;) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(kReadSize, chunk_size - in_chunk));
    ssize_t n = ::pread(fd, buf.get(), want, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      return make_error(Errc::io, fmt::format("cannot read {} at offset {}: {}", path, off,
                                              std::strerror(errno)));
    }
    if (n == 0) break;
    auto len = static_cast<size_t>(n);
    XXH3_128bits_update(whole.get(), buf.get(), len);
    XXH3_128bits_update(chunk.get(), buf.get(), len);
    if (sha) EVP_DigestUpdate(sha.get(), buf.get(), len);
    off += len;
    in_chunk += len;
    if (in_chunk == chunk_size) {
      out.chunks.push_back(hash_hex(XXH3_128bits_digest(chunk.get())));
      XXH3_128bits_reset(chunk.get());
      in_chunk = 0;
    }
  }
  if (in_chunk > 0) out.chunks.push_back(hash_hex(XXH3_128bits_digest(chunk.get())));
  out.xxh3 = hash_hex(XXH3_128bits_digest(whole.get()));
  if (sha) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    EVP_DigestFinal_ex(sha.get(), md, &mdlen);
    out.sha256 = to_hex(md, mdlen);
  }
  return out;
}

Result<Manifest> build_manifest(const std::string& dir, const ManifestOptions& opts) {
  std::error_code ec;
  auto st = fs::symlink_status(dir, ec);
  if (ec || !fs::is_directory(st))
    return make_error(Errc::not_found,
                      fmt::format("model directory {} does not exist or is not a directory", dir));
  Manifest m;
  m.chunk_size = opts.chunk_size;
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec);
  if (ec) return make_error(Errc::io, fmt::format("cannot list {}: {}", dir, ec.message()));
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) return make_error(Errc::io, fmt::format("cannot list {}: {}", dir, ec.message()));
    const auto& e = *it;
    auto rel = fs::relative(e.path(), dir, ec).generic_string();
    auto s = e.symlink_status(ec);
    if (fs::is_symlink(s))
      return make_error(Errc::integrity,
                        fmt::format("{} is a symlink; a staged model holds regular files only: "
                                    "replace the link with the file it points to (e.g. hf "
                                    "download --local-dir)",
                                    e.path().string()));
    if (fs::is_directory(s)) continue;
    if (!fs::is_regular_file(s))
      return make_error(Errc::integrity,
                        fmt::format("{} is not a regular file (device, FIFO or socket); remove "
                                    "it from the model directory",
                                    e.path().string()));
    if (reserved_name(e.path().filename().string())) continue;
    SPARK_TRY(check_manifest_path(rel));
    if (m.files.size() >= kMaxFiles)
      return make_error(Errc::resource, fmt::format("{} holds more than {} files", dir, kMaxFiles));
    struct stat sb {};
    if (::lstat(e.path().c_str(), &sb) != 0)
      return make_error(Errc::io,
                        fmt::format("cannot stat {}: {}", e.path().string(), std::strerror(errno)));
    ManifestEntry f;
    f.path = rel;
    f.size = static_cast<uint64_t>(sb.st_size);
    f.mtime_ns = static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000LL + sb.st_mtim.tv_nsec;
    f.mode = sb.st_mode & 07777;
    m.files.push_back(std::move(f));
  }
  std::sort(m.files.begin(), m.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  uint64_t total = m.total_bytes(), done = 0;
  for (auto& f : m.files) {
    auto h = hash_file(dir + "/" + f.path, m.chunk_size, opts.sha256);
    if (!h) return h.error();
    // A file that changed while we read it would give a manifest that matches nothing.
    struct stat sb {};
    if (::lstat((dir + "/" + f.path).c_str(), &sb) != 0 ||
        static_cast<uint64_t>(sb.st_size) != f.size)
      return make_error(Errc::io, fmt::format("{}/{} changed while it was hashed; wait for the "
                                              "download to finish and run again",
                                              dir, f.path));
    f.xxh3 = std::move(h->xxh3);
    f.chunks = std::move(h->chunks);
    f.sha256 = std::move(h->sha256);
    done += f.size;
    if (opts.progress) opts.progress(f.path, done, total);
  }
  return m;
}

std::string manifest_to_json(const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = kManifestFormat;
  j["digest"] = m.digest();
  j["chunk_size"] = m.chunk_size;
  j["total_bytes"] = m.total_bytes();
  j["files"] = nlohmann::ordered_json::array();
  for (const auto& f : m.files) {
    nlohmann::ordered_json jf;
    jf["path"] = f.path;
    jf["size"] = f.size;
    jf["mtime_ns"] = f.mtime_ns;
    jf["mode"] = fmt::format("{:04o}", f.mode);
    jf["xxh3_128"] = f.xxh3;
    if (!f.sha256.empty()) jf["sha256"] = f.sha256;
    jf["chunks"] = f.chunks;
    j["files"].push_back(std::move(jf));
  }
  return j.dump(1) + "\n";
}

Result<Manifest> parse_manifest_json(std::string_view text, std::string_view where) {
  auto fail = [&](const std::string& why) {
    return make_error(Errc::integrity,
                      fmt::format("{}: invalid manifest: {}; regenerate it with `sparkctl "
                                  "manifest DIR`",
                                  where, why));
  };
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return fail("not JSON");
  if (!j.is_object()) return fail("top level is not an object");
  if (!j.contains("format") || !j["format"].is_string() ||
      j["format"].get_ref<const std::string&>() != kManifestFormat)
    return fail(fmt::format("\"format\" is not \"{}\"", kManifestFormat));
  Manifest m;
  if (!j.contains("chunk_size") || !j["chunk_size"].is_number_unsigned())
    return fail("\"chunk_size\" missing or not a positive integer");
  m.chunk_size = j["chunk_size"].get<uint64_t>();
  if (m.chunk_size < 4096 || m.chunk_size > (1ull << 30))
    return fail(fmt::format("chunk_size {} is outside 4 KiB .. 1 GiB", m.chunk_size));
  if (!j.contains("files") || !j["files"].is_array()) return fail("\"files\" is not an array");
  const auto& files = j["files"];
  if (files.size() > kMaxFiles) return fail("too many files");
  std::set<std::string> seen;
  for (size_t i = 0; i < files.size(); ++i) {
    const auto& jf = files[i];
    auto ctx = [&](const std::string& why) { return fail(fmt::format("files[{}]: {}", i, why)); };
    if (!jf.is_object()) return ctx("not an object");
    ManifestEntry f;
    if (!jf.contains("path") || !jf["path"].is_string()) return ctx("\"path\" is not a string");
    f.path = jf["path"].get<std::string>();
    if (auto s = check_manifest_path(f.path); !s) return fail(s.message());
    if (!seen.insert(f.path).second) return ctx(fmt::format("'{}' is listed twice", f.path));
    if (!jf.contains("size") || !jf["size"].is_number_unsigned())
      return ctx("\"size\" is not a non-negative integer");
    f.size = jf["size"].get<uint64_t>();
    if (f.size > (1ull << 50)) return ctx("\"size\" is implausibly large");
    if (jf.contains("mtime_ns")) {
      if (!jf["mtime_ns"].is_number_integer()) return ctx("\"mtime_ns\" is not an integer");
      f.mtime_ns = jf["mtime_ns"].get<int64_t>();
    }
    if (jf.contains("mode")) {
      if (!jf["mode"].is_string()) return ctx("\"mode\" is not an octal string");
      const auto& ms = jf["mode"].get_ref<const std::string&>();
      if (ms.empty() || ms.size() > 4 ||
          !std::all_of(ms.begin(), ms.end(), [](char c) { return c >= '0' && c <= '7'; }))
        return ctx("\"mode\" is not an octal string");
      f.mode = static_cast<uint32_t>(std::stoul(ms, nullptr, 8)) & 0777;
    }
    if (!jf.contains("xxh3_128") || !jf["xxh3_128"].is_string() ||
        !is_hex(jf["xxh3_128"].get<std::string>(), 32))
      return ctx("\"xxh3_128\" is not 32 lower-case hex digits");
    f.xxh3 = jf["xxh3_128"].get<std::string>();
    if (jf.contains("sha256")) {
      if (!jf["sha256"].is_string() || !is_hex(jf["sha256"].get<std::string>(), 64))
        return ctx("\"sha256\" is not 64 lower-case hex digits");
      f.sha256 = jf["sha256"].get<std::string>();
    }
    if (!jf.contains("chunks") || !jf["chunks"].is_array())
      return ctx("\"chunks\" is not an array");
    const auto& jc = jf["chunks"];
    if (jc.size() != m.chunk_count(f.size))
      return ctx(fmt::format("{} chunk hashes for {} bytes at chunk_size {} (want {})", jc.size(),
                             f.size, m.chunk_size, m.chunk_count(f.size)));
    for (const auto& c : jc) {
      if (!c.is_string() || !is_hex(c.get<std::string>(), 32))
        return ctx("a chunk hash is not 32 lower-case hex digits");
      f.chunks.push_back(c.get<std::string>());
    }
    m.files.push_back(std::move(f));
  }
  std::sort(m.files.begin(), m.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  // A file name that is also a directory prefix of another ("a" and "a/b") cannot exist.
  for (size_t i = 0; i + 1 < m.files.size(); ++i)
    if (starts_with(m.files[i + 1].path, m.files[i].path + "/"))
      return fail(fmt::format("'{}' is both a file and a directory", m.files[i].path));
  if (j.contains("digest")) {
    if (!j["digest"].is_string()) return fail("\"digest\" is not a string");
    if (j["digest"].get<std::string>() != m.digest())
      return fail(fmt::format("recorded digest {} does not match its content ({})",
                              j["digest"].get<std::string>(), m.digest()));
  }
  return m;
}

Result<Manifest> read_manifest(const std::string& dir) {
  std::string path = dir + "/" + kManifestName;
  struct stat sb {};
  if (::lstat(path.c_str(), &sb) != 0)
    return make_error(Errc::not_found, fmt::format("{} does not exist; create it with `sparkctl "
                                                   "manifest {}`",
                                                   path, dir));
  if (!S_ISREG(sb.st_mode))
    return make_error(Errc::integrity, fmt::format("{} is not a regular file (symlink?)", path));
  if (sb.st_size > (512 << 20))
    return make_error(Errc::integrity, fmt::format("{} is larger than 512 MiB", path));
  auto text = read_file(path);
  if (!text)
    return make_error(Errc::io, fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  return parse_manifest_json(*text, path);
}

Status write_manifest(const std::string& dir, const Manifest& m) {
  std::string why;
  if (!write_file_atomic(dir + "/" + kManifestName, manifest_to_json(m), &why))
    return make_error(Errc::io, why);
  return {};
}

VerifyReport verify_manifest(const std::string& dir, const Manifest& m, bool deep) {
  auto t0 = std::chrono::steady_clock::now();
  VerifyReport r;
  r.dir = dir;
  r.digest = m.digest();
  std::set<std::string> listed;
  for (const auto& f : m.files) {
    listed.insert(f.path);
    ++r.files;
    r.bytes += f.size;
    std::string p = dir + "/" + f.path;
    struct stat sb {};
    if (::lstat(p.c_str(), &sb) != 0) {
      r.problems.push_back({f.path, "missing", std::strerror(errno)});
      continue;
    }
    if (!S_ISREG(sb.st_mode)) {
      r.problems.push_back({f.path, "not-regular", "symlink or special file"});
      continue;
    }
    if (static_cast<uint64_t>(sb.st_size) != f.size) {
      r.problems.push_back(
          {f.path, "size", fmt::format("{} bytes, manifest says {}", sb.st_size, f.size)});
      continue;
    }
    int64_t mt = static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000LL + sb.st_mtim.tv_nsec;
    if (!deep && mt == f.mtime_ns) continue;
    auto h = hash_file(p, m.chunk_size, false);
    r.bytes_hashed += f.size;
    if (!h) {
      r.problems.push_back({f.path, "unreadable", h.error().message});
      continue;
    }
    if (h->xxh3 != f.xxh3) {
      size_t bad = 0;
      for (size_t c = 0; c < h->chunks.size() && c < f.chunks.size(); ++c)
        if (h->chunks[c] != f.chunks[c]) ++bad;
      r.problems.push_back({f.path, "hash",
                            fmt::format("xxh3-128 {} but manifest says {} ({} of {} chunks differ)",
                                        h->xxh3, f.xxh3, bad, f.chunks.size())});
    }
  }
  for (const auto& p : r.problems)
    if (p.status != "extra") r.ok = false;
  // Files on disk the manifest does not list: reported, not failures.
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    auto s = it->symlink_status(ec);
    if (fs::is_directory(s)) continue;
    if (reserved_name(it->path().filename().string())) continue;
    auto rel = fs::relative(it->path(), dir, ec).generic_string();
    if (!listed.count(rel)) r.problems.push_back({rel, "extra", "not in the manifest"});
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace spark
