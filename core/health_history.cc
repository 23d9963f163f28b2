#include "core/health_history.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"

namespace spark {

namespace {

constexpr uint32_t kSampleMagic = 0x484b5053;  // "SPKH"
constexpr uint32_t kHeaderMagic = 0x464b5053;  // "SPKF"
constexpr uint16_t kVersion = 1;

// One record as it lies on disk (little-endian hosts: x86-64 and arm64).
struct Record {
  uint32_t magic;
  uint16_t version;
  uint16_t size;
  uint64_t seq;
  int64_t time_ms;
  uint8_t boot_id[16];
  int32_t rank, world_size;
  int64_t mem_available, mem_free, page_cache;
  float psi[5];
  int32_t sm_clock, sm_clock_max, mem_clock, power_mw, power_limit_mw, temp_c;
  uint32_t ranks_alive;
  uint64_t throttle;
  int64_t gpu_mem_used, gpu_mem_total;
  float tokens_per_s;
  int32_t state;
  int64_t step_age_ms;
  char reason[88];
  uint64_t checksum;  // XXH3-64 of every byte before it
};
static_assert(sizeof(Record) == kHistoryRecordSize, "a record is 256 bytes");

struct Header {
  uint32_t magic;
  uint16_t version;
  uint16_t size;
  uint64_t capacity;
  uint8_t pad[kHistoryRecordSize - 24];
  uint64_t checksum;
};
static_assert(sizeof(Header) == kHistoryRecordSize, "the header is one record");

template <class T>
uint64_t sum_of(const T& r) {
  return XXH3_64bits(&r, offsetof(T, checksum));
}

void parse_boot_id(const std::string& s, uint8_t out[16]) {
  std::memset(out, 0, 16);
  std::string hex;
  for (char c : s)
    if (std::isxdigit(static_cast<unsigned char>(c))) hex += c;
  if (hex.size() != 32) return;
  for (int k = 0; k < 16; ++k)
    out[k] =
        static_cast<uint8_t>(std::stoi(hex.substr(static_cast<size_t>(2 * k), 2), nullptr, 16));
}

std::string boot_id_text(const uint8_t b[16]) {
  bool zero = std::all_of(b, b + 16, [](uint8_t x) { return x == 0; });
  if (zero) return "";
  std::string s;
  for (int k = 0; k < 16; ++k) {
    if (k == 4 || k == 6 || k == 8 || k == 10) s += '-';
    s += fmt::format("{:02x}", b[k]);
  }
  return s;
}

Status io_error(const std::string& path, const char* what) {
  return make_error(Errc::io,
                    fmt::format("health history {}: {}: {}", path, what, std::strerror(errno)));
}

bool full_pwrite(int fd, const void* p, size_t n, off_t at) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, c, n, at);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
    at += w;
  }
  return true;
}

}  // namespace

std::string encode_sample(const HealthSample& s) {
  Record r{};
  r.magic = kSampleMagic;
  r.version = kVersion;
  r.size = kHistoryRecordSize;
  r.seq = s.seq;
  r.time_ms = s.time_ms;
  parse_boot_id(s.boot_id, r.boot_id);
  r.rank = s.rank;
  r.world_size = s.world_size;
  r.mem_available = s.mem_available;
  r.mem_free = s.mem_free;
  r.page_cache = s.page_cache;
  double psi[5] = {s.psi_mem_some, s.psi_mem_full, s.psi_cpu_some, s.psi_io_some, s.psi_io_full};
  for (int k = 0; k < 5; ++k) r.psi[k] = static_cast<float>(psi[k]);
  r.sm_clock = s.sm_clock_mhz;
  r.sm_clock_max = s.sm_clock_max_mhz;
  r.mem_clock = s.mem_clock_mhz;
  r.power_mw = s.power_mw;
  r.power_limit_mw = s.power_limit_mw;
  r.temp_c = s.temp_c;
  r.ranks_alive = s.ranks_alive;
  r.throttle = s.throttle_reasons;
  r.gpu_mem_used = s.gpu_mem_used;
  r.gpu_mem_total = s.gpu_mem_total;
  r.tokens_per_s = static_cast<float>(s.tokens_per_s);
  r.state = s.state;
  r.step_age_ms = s.step_age_ms;
  std::strncpy(r.reason, s.reason.c_str(), sizeof r.reason - 1);
  r.checksum = sum_of(r);
  return std::string(reinterpret_cast<const char*>(&r), sizeof r);
}

bool decode_sample(const void* record, HealthSample* out) {
  Record r;
  std::memcpy(&r, record, sizeof r);
  if (r.magic != kSampleMagic || r.version != kVersion || r.size != kHistoryRecordSize ||
      r.seq == 0 || r.checksum != sum_of(r))
    return false;
  HealthSample s;
  s.seq = r.seq;
  s.time_ms = r.time_ms;
  s.boot_id = boot_id_text(r.boot_id);
  s.rank = r.rank;
  s.world_size = r.world_size;
  s.mem_available = r.mem_available;
  s.mem_free = r.mem_free;
  s.page_cache = r.page_cache;
  s.psi_mem_some = r.psi[0];
  s.psi_mem_full = r.psi[1];
  s.psi_cpu_some = r.psi[2];
  s.psi_io_some = r.psi[3];
  s.psi_io_full = r.psi[4];
  s.sm_clock_mhz = r.sm_clock;
  s.sm_clock_max_mhz = r.sm_clock_max;
  s.mem_clock_mhz = r.mem_clock;
  s.power_mw = r.power_mw;
  s.power_limit_mw = r.power_limit_mw;
  s.temp_c = r.temp_c;
  s.ranks_alive = r.ranks_alive;
  s.throttle_reasons = r.throttle;
  s.gpu_mem_used = r.gpu_mem_used;
  s.gpu_mem_total = r.gpu_mem_total;
  s.tokens_per_s = r.tokens_per_s;
  s.state = r.state;
  s.step_age_ms = r.step_age_ms;
  r.reason[sizeof r.reason - 1] = 0;
  s.reason = r.reason;
  *out = std::move(s);
  return true;
}

HistoryWriter::~HistoryWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Status HistoryWriter::open(const std::string& path, uint64_t capacity) {
  if (capacity == 0) return make_error(Errc::config, "health history: capacity 0");
  path_ = path;
  capacity_ = capacity;
  std::error_code ec = make_dirs(std::filesystem::path(path).parent_path().string());
  if (ec)
    return make_error(Errc::io, fmt::format("health history {}: cannot create its directory: {}",
                                            path, ec.message()));
  auto existing = read_history(path);
  bool reuse = false;
  if (existing.ok()) {
    // Same capacity (read_history checked the header): go on after the newest sample.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    Header h{};
    if (fd >= 0 && ::pread(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) &&
        h.capacity == capacity)
      reuse = true;
    if (fd >= 0) ::close(fd);
    if (reuse)
      for (const auto& s : *existing) seq_ = std::max(seq_, s.seq);
  }
  if (!reuse && std::filesystem::exists(path, ec)) std::filesystem::rename(path, path + ".old", ec);
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DSYNC, 0640);
  if (fd_ < 0) return io_error(path, "open");
  if (!reuse) {
    Header h{};
    h.magic = kHeaderMagic;
    h.version = kVersion;
    h.size = kHistoryRecordSize;
    h.capacity = capacity;
    h.checksum = sum_of(h);
    // The whole file at once (zeros are empty slots), so that a sample never extends it.
    if (::ftruncate(fd_, static_cast<off_t>((capacity + 1) * kHistoryRecordSize)) != 0)
      return io_error(path, "ftruncate");
    if (!full_pwrite(fd_, &h, sizeof h, 0)) return io_error(path, "write header");
    if (::fsync(fd_) != 0) return io_error(path, "fsync");
  }
  return Status::Ok();
}

Status HistoryWriter::append(HealthSample& s) {
  if (fd_ < 0) return make_error(Errc::internal, "health history: not open");
  s.seq = seq_ + 1;
  auto rec = encode_sample(s);
  off_t at = static_cast<off_t>((1 + (s.seq - 1) % capacity_) * kHistoryRecordSize);
  if (!full_pwrite(fd_, rec.data(), rec.size(), at)) return io_error(path_, "write sample");
  seq_ = s.seq;
  return Status::Ok();
}

Result<std::vector<HealthSample>> read_history(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT)
      return make_error(Errc::not_found, fmt::format("health history {}: no such file", path));
    return make_error(Errc::io, fmt::format("health history {}: {}", path, std::strerror(errno)));
  }
  struct stat st {};
  Header h{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      ::pread(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) || h.magic != kHeaderMagic ||
      h.version != kVersion || h.size != kHistoryRecordSize || h.checksum != sum_of(h) ||
      h.capacity == 0 || h.capacity > (uint64_t{1} << 24)) {
    ::close(fd);
    return make_error(
        Errc::integrity,
        fmt::format("health history {}: not a health history file (version {})", path, kVersion));
  }
  uint64_t slots =
      std::min<uint64_t>(h.capacity, static_cast<uint64_t>(st.st_size) / kHistoryRecordSize - 1);
  std::string buf(slots * kHistoryRecordSize, '\0');
  ssize_t n = ::pread(fd, buf.data(), buf.size(), kHistoryRecordSize);
  ::close(fd);
  if (n < 0) return make_error(Errc::io, fmt::format("health history {}: read failed", path));
  std::vector<HealthSample> out;
  for (size_t off = 0; off + kHistoryRecordSize <= static_cast<size_t>(n);
       off += kHistoryRecordSize) {
    HealthSample s;
    if (decode_sample(buf.data() + off, &s)) out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(),
            [](const HealthSample& a, const HealthSample& b) { return a.seq < b.seq; });
  return out;
}

std::string history_path(const std::string& state_dir, int rank) {
  return fmt::format("{}/history/health-rank{}.bin", state_dir, rank);
}

nlohmann::json to_json(const HealthSample& s) {
  auto num = [](double v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); };
  auto i64 = [](int64_t v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); };
  return {
      {"seq", s.seq},
      {"time_ms", s.time_ms},
      {"boot_id", s.boot_id},
      {"rank", s.rank},
      {"world_size", s.world_size},
      {"mem_available", i64(s.mem_available)},
      {"mem_free", i64(s.mem_free)},
      {"page_cache", i64(s.page_cache)},
      {"psi_memory_some", num(s.psi_mem_some)},
      {"psi_memory_full", num(s.psi_mem_full)},
      {"psi_cpu_some", num(s.psi_cpu_some)},
      {"psi_io_some", num(s.psi_io_some)},
      {"psi_io_full", num(s.psi_io_full)},
      {"sm_clock_mhz", i64(s.sm_clock_mhz)},
      {"sm_clock_max_mhz", i64(s.sm_clock_max_mhz)},
      {"mem_clock_mhz", i64(s.mem_clock_mhz)},
      {"power_w", s.power_mw < 0 ? nlohmann::json(nullptr) : nlohmann::json(s.power_mw / 1000.0)},
      {"power_limit_w",
       s.power_limit_mw < 0 ? nlohmann::json(nullptr) : nlohmann::json(s.power_limit_mw / 1000.0)},
      {"temp_c", i64(s.temp_c)},
      {"throttle_reasons", s.throttle_reasons == HealthSample::kUnknownThrottle
                               ? nlohmann::json(nullptr)
                               : nlohmann::json(s.throttle_reasons)},
      {"gpu_mem_used", i64(s.gpu_mem_used)},
      {"gpu_mem_total", i64(s.gpu_mem_total)},
      {"tokens_per_s", num(s.tokens_per_s)},
      {"step_age_ms", i64(s.step_age_ms)},
      {"ranks_alive", s.ranks_alive},
      {"state", s.state},
      {"reason", s.reason}};
}

HealthSample sample_from_json(const nlohmann::json& j) {
  HealthSample s;
  auto i = [&](const char* k, int64_t d = -1) {
    return j.contains(k) && j[k].is_number() ? j[k].get<int64_t>() : d;
  };
  auto f = [&](const char* k) {
    return j.contains(k) && j[k].is_number() ? j[k].get<double>() : -1.0;
  };
  s.seq = static_cast<uint64_t>(i("seq", 0));
  s.time_ms = i("time_ms", 0);
  s.boot_id = j.value("boot_id", "");
  s.rank = static_cast<int>(i("rank", 0));
  s.world_size = static_cast<int>(i("world_size", 1));
  s.mem_available = i("mem_available");
  s.mem_free = i("mem_free");
  s.page_cache = i("page_cache");
  s.psi_mem_some = f("psi_memory_some");
  s.psi_mem_full = f("psi_memory_full");
  s.psi_cpu_some = f("psi_cpu_some");
  s.psi_io_some = f("psi_io_some");
  s.psi_io_full = f("psi_io_full");
  s.sm_clock_mhz = static_cast<int>(i("sm_clock_mhz"));
  s.sm_clock_max_mhz = static_cast<int>(i("sm_clock_max_mhz"));
  s.mem_clock_mhz = static_cast<int>(i("mem_clock_mhz"));
  double p = f("power_w"), pl = f("power_limit_w");
  s.power_mw = p < 0 ? -1 : static_cast<int>(p * 1000 + 0.5);
  s.power_limit_mw = pl < 0 ? -1 : static_cast<int>(pl * 1000 + 0.5);
  s.temp_c = static_cast<int>(i("temp_c"));
  s.throttle_reasons = j.contains("throttle_reasons") && j["throttle_reasons"].is_number()
                           ? j["throttle_reasons"].get<uint64_t>()
                           : HealthSample::kUnknownThrottle;
  s.gpu_mem_used = i("gpu_mem_used");
  s.gpu_mem_total = i("gpu_mem_total");
  s.tokens_per_s = f("tokens_per_s");
  s.step_age_ms = i("step_age_ms");
  s.ranks_alive = static_cast<uint32_t>(i("ranks_alive", 0));
  s.state = static_cast<int>(i("state", 0));
  s.reason = j.value("reason", "");
  return s;
}

}  // namespace spark
