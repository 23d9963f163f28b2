#pragma once
// StageManifest: what a model directory holds (every regular file's relative name, size,
// mtime, mode, xxh3-128 of the whole file and of every chunk, optionally sha256), written
// as JSON beside the model. Its digest (content only: names, sizes, hashes) is what
// preflight compares across nodes and what stage-weights copies and verifies against.
// Names are validated on every path in: a manifest can never name a file outside its
// directory (no "..", no absolute names, no symlinks on disk).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark {

/// File name of the manifest inside a model directory.
inline constexpr const char* kManifestName = ".sparkctl-manifest.json";
/// Suffix of a file being received (never a final name).
inline constexpr const char* kPartialSuffix = ".sparkctl-partial";
/// Suffix of the resume journal of a partial file (verified chunks).
inline constexpr const char* kJournalSuffix = ".sparkctl-journal";
/// Format tag written into every manifest.
inline constexpr const char* kManifestFormat = "sparkctl-manifest/1";
/// Default chunk size: the unit of resume and of per-chunk verification.
inline constexpr uint64_t kDefaultChunkSize = 64ull << 20;

/// One regular file of the model.
struct ManifestEntry {
  std::string path;  // relative, '/'-separated, validated
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint32_t mode = 0644;             // permission bits
  std::string xxh3;                 // 32 hex digits, XXH3-128 of the whole file
  std::string sha256;               // 64 hex digits or empty
  std::vector<std::string> chunks;  // XXH3-128 of each chunk_size piece (last may be short)
};

/// The manifest of one directory.
struct Manifest {
  uint64_t chunk_size = kDefaultChunkSize;
  std::vector<ManifestEntry> files;  // sorted by path

  /// Stable content digest (hex, 32 digits): names, sizes and whole-file hashes.
  std::string digest() const;
  /// Sum of file sizes.
  uint64_t total_bytes() const;
  /// Number of chunks of a file of `size` bytes.
  uint64_t chunk_count(uint64_t size) const {
    return chunk_size == 0 ? 0 : (size + chunk_size - 1) / chunk_size;
  }
  /// Bytes in chunk `i` of a file of `size` bytes.
  uint64_t chunk_len(uint64_t size, uint64_t i) const {
    uint64_t off = i * chunk_size;
    return off >= size ? 0 : std::min(chunk_size, size - off);
  }
};

/// Checks that `name` is a safe relative path: not empty, not absolute, no "." or ".."
/// component, no empty component, no NUL/backslash/control characters, not one of our
/// reserved names. Returns an Errc::integrity error naming it otherwise.
Status check_manifest_path(const std::string& name);

/// Options for building a manifest.
struct ManifestOptions {
  uint64_t chunk_size = kDefaultChunkSize;
  bool sha256 = false;
  /// Called after each file with (path, bytes hashed so far, total bytes).
  std::function<void(const std::string&, uint64_t, uint64_t)> progress;
};

/// Walks `dir` (regular files only; symlinks, devices, FIFOs and sockets are errors naming
/// the file) and hashes every file, skipping our own manifest/partial/journal files.
Result<Manifest> build_manifest(const std::string& dir, const ManifestOptions& opts);

/// Hashes of one file: whole-file XXH3-128, per-chunk XXH3-128, optional sha256.
struct FileHashes {
  std::string xxh3;
  std::vector<std::string> chunks;
  std::string sha256;
};
/// Hashes one file in one sequential pass with large reads.
Result<FileHashes> hash_file(const std::string& path, uint64_t chunk_size, bool sha256);
/// XXH3-128 of a buffer as 32 hex digits (high 64 bits first, as `xxhsum -H2` prints).
std::string xxh3_hex(const void* data, size_t n);

/// Serializes to JSON text (stable order).
std::string manifest_to_json(const Manifest& m);
/// Parses and validates manifest JSON. Every field is type-checked; names are checked with
/// check_manifest_path; sizes, chunk counts and hex digests must be consistent. Never throws.
Result<Manifest> parse_manifest_json(std::string_view text, std::string_view where);
/// Reads DIR/.sparkctl-manifest.json.
Result<Manifest> read_manifest(const std::string& dir);
/// Writes DIR/.sparkctl-manifest.json atomically.
Status write_manifest(const std::string& dir, const Manifest& m);

/// Outcome of checking one file against its manifest entry.
struct FileCheck {
  std::string path;
  std::string status;  // ok | missing | size | hash | not-regular | unreadable | extra
  std::string detail;
};

/// Outcome of verifying a directory.
struct VerifyReport {
  std::string dir;
  std::string digest;
  uint64_t files = 0;
  uint64_t bytes = 0;
  uint64_t bytes_hashed = 0;
  std::vector<FileCheck> problems;  // everything not ok (extras are listed, not failures)
  bool ok = true;
  double seconds = 0;
};

/// Verifies `dir` against `m`. deep: rehash every file; otherwise size+mtime agreeing skips
/// the hash and a differing mtime triggers one.
VerifyReport verify_manifest(const std::string& dir, const Manifest& m, bool deep);

}  // namespace spark
