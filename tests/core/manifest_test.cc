#include "core/manifest.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>

#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;

namespace {

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

void flip_byte(const std::string& path, off_t off) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  char c = 0;
  REQUIRE(::pread(fd, &c, 1, off) == 1);
  c = static_cast<char>(c ^ 1);
  REQUIRE(::pwrite(fd, &c, 1, off) == 1);
  ::close(fd);
}

}  // namespace

TEST_CASE("xxh3-128 and sha256 match their published test vectors") {
  CHECK(xxh3_hex("", 0) == "99aa06d3014798d86001c324468d497f");
  test::TempDir d("spark-manifest");
  auto p = d.write("abc", "abc");
  auto h = hash_file(p, 4096, true);
  REQUIRE(h.ok());
  CHECK(h->sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(h->xxh3 == xxh3_hex("abc", 3));
  CHECK(h->chunks.size() == 1);
}

TEST_CASE(
    "a manifest lists every regular file with per-chunk hashes and round-trips through JSON") {
  test::TempDir d("spark-manifest");
  d.write("config.json", "{\"a\":1}");
  d.write("model-00001-of-00002.safetensors", random_bytes(300000, 1));
  d.write("sub/tokenizer.json", random_bytes(5000, 2));
  d.write("empty", "");
  ManifestOptions o;
  o.chunk_size = 64 * 1024;
  auto m = build_manifest(d.path(), o);
  REQUIRE(m.ok());
  REQUIRE(m->files.size() == 4);
  CHECK(m->files[0].path == "config.json");
  CHECK(m->files[1].path == "empty");
  CHECK(m->files[1].chunks.empty());
  CHECK(m->files[2].chunks.size() == 5);  // 300000 / 65536 rounded up
  CHECK(m->files[3].path == "sub/tokenizer.json");
  // Chunk hashes are hashes of the chunks.
  auto bytes = *read_file(d / "model-00001-of-00002.safetensors");
  CHECK(m->files[2].chunks[4] == xxh3_hex(bytes.data() + 4 * 65536, 300000 - 4 * 65536));
  CHECK(m->files[2].xxh3 == xxh3_hex(bytes.data(), bytes.size()));

  REQUIRE(write_manifest(d.path(), *m).ok());
  auto back = read_manifest(d.path());
  REQUIRE(back.ok());
  CHECK(back->digest() == m->digest());
  CHECK(back->files[2].chunks == m->files[2].chunks);
  CHECK(back->files[2].mtime_ns == m->files[2].mtime_ns);
  // The manifest does not list itself, and rebuilding gives the same digest.
  auto again = build_manifest(d.path(), o);
  REQUIRE(again.ok());
  CHECK(again->files.size() == 4);
  CHECK(again->digest() == m->digest());
}

TEST_CASE("the digest covers content, not mtimes") {
  test::TempDir d("spark-manifest");
  d.write("a", "hello");
  auto m1 = build_manifest(d.path(), {});
  REQUIRE(m1.ok());
  auto m2 = *m1;
  m2.files[0].mtime_ns += 12345;
  CHECK(m2.digest() == m1->digest());
  m2.files[0].xxh3 = std::string(32, '0');
  CHECK(m2.digest() != m1->digest());
}

TEST_CASE("hostile names are rejected with a message naming them") {
  for (const char* bad :
       {"../x", "/etc/passwd", "a/../../x", "a/./b", ".", "..", "", "a//b", "a/", "a\\b", "x\n",
        ".sparkctl-manifest.json", "w.sparkctl-partial", "w.sparkctl-journal"}) {
    auto s = check_manifest_path(bad);
    CHECK_MESSAGE(!s.ok(), bad);
    CHECK(s.code() == Errc::integrity);
  }
  CHECK(check_manifest_path("a/b/c.safetensors").ok());
  CHECK(check_manifest_path("..a").ok());

  // The same through JSON: an entry escaping the directory fails the whole manifest.
  std::string chunk = std::string(32, 'a');
  for (const char* bad : {"../x", "/etc/x"}) {
    std::string j = std::string("{\"format\":\"sparkctl-manifest/1\",\"chunk_size\":65536,") +
                    "\"files\":[{\"path\":\"" + bad + "\",\"size\":1,\"xxh3_128\":\"" + chunk +
                    "\",\"chunks\":[\"" + chunk + "\"]}]}";
    auto m = parse_manifest_json(j, "hostile.json");
    REQUIRE(!m.ok());
    CHECK(m.error().code == Errc::integrity);
    CHECK(m.error().message.find(bad) != std::string::npos);
  }
}

TEST_CASE("malformed manifests are rejected, never crash") {
  std::string h = std::string(32, 'b');
  auto file = [&](const std::string& extra) {
    return "{\"format\":\"sparkctl-manifest/1\",\"chunk_size\":65536,\"files\":[" + extra + "]}";
  };
  std::vector<std::string> bad = {
      "",
      "[]",
      "{}",
      "null",
      "{\"format\":\"other\"}",
      "{\"format\":\"sparkctl-manifest/1\",\"chunk_size\":-1,\"files\":[]}",
      "{\"format\":\"sparkctl-manifest/1\",\"chunk_size\":1,\"files\":[]}",
      file("1"),
      file("{\"path\":5}"),
      file("{\"path\":\"a\",\"size\":-3,\"xxh3_128\":\"" + h + "\",\"chunks\":[]}"),
      file("{\"path\":\"a\",\"size\":1,\"xxh3_128\":\"xyz\",\"chunks\":[\"" + h + "\"]}"),
      file("{\"path\":\"a\",\"size\":1,\"xxh3_128\":\"" + h + "\",\"chunks\":[]}"),  // count
      file("{\"path\":\"a\",\"size\":0,\"xxh3_128\":\"" + h +
           "\",\"chunks\":[]},"
           "{\"path\":\"a\",\"size\":0,\"xxh3_128\":\"" +
           h + "\",\"chunks\":[]}"),  // duplicate
      file("{\"path\":\"a\",\"size\":0,\"xxh3_128\":\"" + h +
           "\",\"chunks\":[]},"
           "{\"path\":\"a/b\",\"size\":0,\"xxh3_128\":\"" +
           h + "\",\"chunks\":[]}"),  // file+dir
      file("{\"path\":\"a\",\"size\":0,\"mode\":\"99\",\"xxh3_128\":\"" + h + "\",\"chunks\":[]}"),
  };
  for (const auto& t : bad) {
    auto m = parse_manifest_json(t, "t.json");
    CHECK_MESSAGE(!m.ok(), t);
  }
  auto good = parse_manifest_json(
      file("{\"path\":\"a\",\"size\":0,\"xxh3_128\":\"" + h + "\",\"chunks\":[]}"), "t.json");
  CHECK(good.ok());
  // A recorded digest that does not match the content is tampering or damage.
  auto m = *good;
  std::string j = manifest_to_json(m);
  auto pos = j.find(m.digest());
  REQUIRE(pos != std::string::npos);
  j[pos] = j[pos] == '0' ? '1' : '0';
  CHECK(!parse_manifest_json(j, "t.json").ok());
}

TEST_CASE("a symlink or a FIFO in the model directory is an error naming it") {
  test::TempDir d("spark-manifest");
  d.write("real", "x");
  REQUIRE(::symlink("/etc/passwd", (d / "link").c_str()) == 0);
  auto m = build_manifest(d.path(), {});
  REQUIRE(!m.ok());
  CHECK(m.error().message.find("link") != std::string::npos);
  CHECK(m.error().message.find("symlink") != std::string::npos);
  ::unlink((d / "link").c_str());
  REQUIRE(::mkfifo((d / "fifo").c_str(), 0600) == 0);
  auto m2 = build_manifest(d.path(), {});
  REQUIRE(!m2.ok());
  CHECK(m2.error().message.find("fifo") != std::string::npos);
}

TEST_CASE(
    "verify finds a flipped byte (deep), a size change and a missing file; quick trusts mtime") {
  test::TempDir d("spark-manifest");
  d.write("big", random_bytes(200000, 3));
  d.write("small", "abc");
  d.write("gone", "x");
  ManifestOptions o;
  o.chunk_size = 65536;
  auto m = build_manifest(d.path(), o);
  REQUIRE(m.ok());
  CHECK(verify_manifest(d.path(), *m, true).ok);

  struct stat sb {};
  REQUIRE(::stat((d / "big").c_str(), &sb) == 0);
  flip_byte(d / "big", 70000);  // chunk 1
  timespec ts[2] = {sb.st_mtim, sb.st_mtim};
  REQUIRE(::utimensat(AT_FDCWD, (d / "big").c_str(), ts, 0) == 0);  // hide it from mtime
  CHECK(verify_manifest(d.path(), *m, false).ok);                   // quick: size+mtime agree
  auto deep = verify_manifest(d.path(), *m, true);
  CHECK(!deep.ok);
  REQUIRE(deep.problems.size() == 1);
  CHECK(deep.problems[0].path == "big");
  CHECK(deep.problems[0].status == "hash");
  CHECK(deep.problems[0].detail.find("1 of 4 chunks differ") != std::string::npos);

  d.write("small", "abcd");
  ::unlink((d / "gone").c_str());
  d.write("new", "n");
  auto r = verify_manifest(d.path(), *m, false);
  CHECK(!r.ok);
  std::map<std::string, std::string> st;
  for (const auto& p : r.problems) st[p.path] = p.status;
  CHECK(st["small"] == "size");
  CHECK(st["gone"] == "missing");
  CHECK(st["new"] == "extra");
}
