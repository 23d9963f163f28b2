// Safetensors reader: round trips, slices, dtype conversion, header validation, page cache.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "daemon/engine/checkpoint.h"
#include "daemon/engine/safetensors.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::engine;

namespace {

std::string file_with_header(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

Errc header_error(const std::string& json, size_t data_bytes) {
  std::string f = file_with_header(json, std::string(data_bytes, '\0'));
  auto r = parse_safetensors_header(f, f.size(), "test.safetensors");
  return r ? Errc::ok : r.error().code;
}

// Pages of `path` resident in the page cache (mincore).
size_t resident_pages(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  struct stat st {};
  ::fstat(fd, &st);
  size_t len = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
  REQUIRE(p != MAP_FAILED);
  long page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> vec((len + static_cast<size_t>(page) - 1) / static_cast<size_t>(page));
  REQUIRE(::mincore(p, len, vec.data()) == 0);
  size_t n = 0;
  for (auto v : vec) n += v & 1;
  ::munmap(p, len);
  ::close(fd);
  return n;
}

}  // namespace

TEST_CASE("safetensors: F32 and BF16 round trip, row and column slices") {
  test::TempDir dir;
  std::vector<float> a(6 * 5);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i) * 0.37f - 3.0f;
  std::vector<float> b = {1.0f, -2.5f, 3.25f};
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::string path = dir / (std::string(dtype_name(dt)) + ".safetensors");
    REQUIRE(write_safetensors(path, {{"a", {6, 5}, a.data()}, {"b", {3}, b.data()}}, dt,
                              {{"format", "pt"}})
                .ok());
    auto f = SafetensorsFile::open(path);
    REQUIRE_MESSAGE(f.ok(), (f.ok() ? std::string() : f.error().message));
    CHECK(f->header().metadata.at("format") == "pt");
    const TensorInfo* ta = f->find("a");
    REQUIRE(ta);
    CHECK(ta->dtype == dt);
    CHECK(ta->shape == std::vector<int64_t>{6, 5});
    auto expect = [&](float v) { return dt == DType::f32 ? v : bf16_to_float(float_to_bf16(v)); };
    std::vector<float> full(30);
    REQUIRE(f->read(*ta, Slice{}, full.data()).ok());
    for (size_t i = 0; i < 30; ++i) CHECK(full[i] == expect(a[i]));
    std::vector<float> rows(2 * 5);
    REQUIRE(f->read(*ta, Slice{2, 2, 0, -1}, rows.data()).ok());
    for (size_t i = 0; i < 10; ++i) CHECK(rows[i] == expect(a[10 + i]));
    std::vector<float> cols(6 * 2);
    REQUIRE(f->read(*ta, Slice{0, -1, 3, 2}, cols.data()).ok());
    for (size_t r = 0; r < 6; ++r)
      for (size_t cc = 0; cc < 2; ++cc) CHECK(cols[r * 2 + cc] == expect(a[r * 5 + 3 + cc]));
    std::vector<float> bb(1);
    REQUIRE(f->read(*f->find("b"), Slice{1, 1, 0, -1}, bb.data()).ok());
    CHECK(bb[0] == expect(-2.5f));
    // A slice outside the tensor is refused.
    CHECK_FALSE(f->read(*ta, Slice{5, 2, 0, -1}, full.data()).ok());
  }
}

TEST_CASE("safetensors: F16 and BF16 conversion including subnormals and infinities") {
  CHECK(f16_to_float(0x3c00) == 1.0f);
  CHECK(f16_to_float(0xc000) == -2.0f);
  CHECK(f16_to_float(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(f16_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(f16_to_float(0x7bff) == 65504.0f);
  CHECK(std::isinf(f16_to_float(0x7c00)));
  CHECK(std::isnan(f16_to_float(0x7e00)));
  CHECK(f16_to_float(0x8000) == 0.0f);
  CHECK(std::signbit(f16_to_float(0x8000)));
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(1.00390625f) == 0x3f80);  // halfway: rounds to even
  CHECK(float_to_bf16(1.01171875f) == 0x3f82);  // halfway: rounds to even (up)

  // An F16 tensor written by hand is read as floats.
  test::TempDir dir;
  const uint16_t vals[4] = {0x3c00, 0xc000, 0x3555, 0x0001};
  std::string data(reinterpret_cast<const char*>(vals), 8);
  auto path = dir.write(
      "h.safetensors",
      file_with_header(R"({"h":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", data));
  auto f = SafetensorsFile::open(path);
  REQUIRE(f.ok());
  float out[4];
  REQUIRE(f->read(*f->find("h"), Slice{}, out).ok());
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == doctest::Approx(0.33325195f));
  CHECK(out[3] == std::ldexp(1.0f, -24));
}

TEST_CASE("safetensors: invalid headers are refused with Errc::integrity") {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(header_error(ok, 8) == Errc::ok);
  CHECK(header_error(
            R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
            8) == Errc::ok);
  CHECK(header_error(ok, 4) == Errc::integrity);  // past the end
  CHECK(header_error(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 16) ==
        Errc::integrity);  // shape vs bytes
  CHECK(header_error(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8) ==
        Errc::integrity);  // dtype
  CHECK(header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8) ==
        Errc::integrity);  // reversed
  CHECK(header_error(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8) ==
        Errc::integrity);  // negative
  CHECK(header_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                     12) == Errc::integrity);  // overlap
  CHECK(header_error(R"({"__metadata__":{"k":1}})", 0) ==
        Errc::integrity);  // metadata values are strings
  CHECK(header_error(
            R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8) ==
        Errc::integrity);
  CHECK(header_error("not json", 0) == Errc::integrity);
  CHECK(header_error("[1,2]", 0) == Errc::integrity);
  CHECK(header_error(std::string(100, '[') + std::string(100, ']'), 0) == Errc::integrity);
  // Length prefix larger than the file.
  std::string f = file_with_header(ok, std::string(8, '\0'));
  f[0] = static_cast<char>(0xff);
  f[1] = static_cast<char>(0xff);
  CHECK_FALSE(parse_safetensors_header(f, f.size(), "x").ok());
  CHECK_FALSE(parse_safetensors_header("abc", 3, "x").ok());
  // The message names the file and the tensor.
  std::string g = file_with_header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                                   std::string(8, '\0'));
  auto r = parse_safetensors_header(g, g.size(), "/m/model.safetensors");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("/m/model.safetensors") != std::string::npos);
  CHECK(r.error().message.find("\"w\"") != std::string::npos);
}

TEST_CASE("safetensors: a truncated file is refused on open, not crashed on") {
  test::TempDir dir;
  std::vector<float> a(64, 1.0f);
  const std::string path = dir / "t.safetensors";
  REQUIRE(write_safetensors(path, {{"a", {64}, a.data()}}, DType::f32).ok());
  REQUIRE(::truncate(path.c_str(), 100) == 0);
  auto f = SafetensorsFile::open(path);
  REQUIRE_FALSE(f.ok());
  CHECK(f.error().code == Errc::integrity);
}

TEST_CASE("checkpoint: sharded index, shape check, page cache dropped after reading") {
  test::TempDir dir;
  std::vector<float> a(4096, 0.5f), b(4096, -1.0f);
  REQUIRE(write_safetensors(dir / "model-00001-of-00002.safetensors", {{"x.a", {64, 64}, a.data()}},
                            DType::f32)
              .ok());
  REQUIRE(write_safetensors(dir / "model-00002-of-00002.safetensors", {{"x.b", {64, 64}, b.data()}},
                            DType::bf16)
              .ok());
  dir.write(
      "model.safetensors.index.json",
      R"({"metadata":{},"weight_map":{"x.a":"model-00001-of-00002.safetensors","x.b":"model-00002-of-00002.safetensors"}})");
  auto ck = Checkpoint::open(dir.path());
  REQUIRE_MESSAGE(ck.ok(), (ck.ok() ? std::string() : ck.error().message));
  std::vector<float> out(64 * 64);
  REQUIRE(ck->read("x.b", {64, 64}, Slice{}, out.data()).ok());
  CHECK(out[100] == -1.0f);
  auto bad_shape = ck->read("x.a", {64, 32}, Slice{}, out.data());
  CHECK(bad_shape.code() == Errc::integrity);
  CHECK(ck->read("x.c", {1}, Slice{}, out.data()).code() == Errc::not_found);
  // Column slice reads only its bytes.
  const uint64_t before = ck->bytes_read();
  REQUIRE(ck->read("x.a", {64, 64}, Slice{0, -1, 32, 32}, out.data()).ok());
  CHECK(ck->bytes_read() - before == 64 * 32 * 4);
  // Page cache: resident after reading, gone after drop_page_cache.
  const std::string f1 = dir / "model-00001-of-00002.safetensors";
  REQUIRE(ck->read("x.a", {64, 64}, Slice{}, out.data()).ok());
  CHECK(resident_pages(f1) > 0);
  ck->drop_page_cache();
  CHECK(resident_pages(f1) == 0);

  // An index that lists a tensor its file lacks is refused.
  dir.write(
      "model.safetensors.index.json",
      R"({"weight_map":{"x.a":"model-00002-of-00002.safetensors","x.b":"model-00002-of-00002.safetensors"}})");
  auto bad = Checkpoint::open(dir.path());
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("x.a") != std::string::npos);
}
