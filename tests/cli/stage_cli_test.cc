// The manifest, cache-stat and evict commands through sparkctl's command line (in process).
#include <doctest/doctest.h>
#include <linux/magic.h>
#include <sys/statfs.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/manifest.h"
#include "support/tempdir.h"

using namespace spark;
using json = nlohmann::json;

namespace {

struct Out {
  int rc = -1;
  std::string out, err;
};

Out sparkctl(std::vector<std::string> args) {
  args.insert(args.begin(), "sparkctl");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream o, e;
  Out r;
  r.rc = cli::run(static_cast<int>(argv.size()), argv.data(), o, e, Environment{});
  r.out = o.str();
  r.err = e.str();
  return r;
}

}  // namespace

TEST_CASE("cli: manifest creates, verifies, and fails with 13 on a damaged file") {
  test::TempDir d("spark-cli-manifest");
  d.write("model.safetensors", std::string(100000, 'w'));
  d.write("config.json", "{}");
  auto c = sparkctl({"--json", "manifest", d.path(), "--chunk-size", "16KiB", "--sha256"});
  REQUIRE(c.rc == 0);
  auto j = json::parse(c.out);
  CHECK(j["files"].get<int>() == 2);
  CHECK(j["digest"].get<std::string>().size() == 32);
  auto v = sparkctl({"--json", "manifest", d.path(), "--verify"});
  CHECK(v.rc == 0);
  CHECK(json::parse(v.out)["ok"].get<bool>());
  d.write("model.safetensors", std::string(99999, 'w') + "x");
  auto bad = sparkctl({"manifest", d.path(), "--verify"});
  CHECK(bad.rc == exit_code(Errc::integrity));
  CHECK(bad.out.find("MISMATCH") != std::string::npos);
  // A hostile manifest on disk is refused with its name in the message.
  d.write(kManifestName,
          "{\"format\":\"sparkctl-manifest/1\",\"chunk_size\":65536,\"files\":"
          "[{\"path\":\"../../etc/shadow\",\"size\":0,\"xxh3_128\":\"" +
              std::string(32, 'a') + "\",\"chunks\":[]}]}");
  auto h = sparkctl({"manifest", d.path(), "--verify"});
  CHECK(h.rc == exit_code(Errc::integrity));
  CHECK(h.err.find("../../etc/shadow") != std::string::npos);
  CHECK(sparkctl({"manifest"}).rc == exit_code(Errc::usage));
}

TEST_CASE("cli: cache-stat and evict --local report residency before and after") {
  test::TempDir d("spark-cli-cache");
  struct statfs s {};
  REQUIRE(::statfs(d.path().c_str(), &s) == 0);
  if (s.f_type == TMPFS_MAGIC) {
    MESSAGE("SKIP: " << d.path() << " is tmpfs");
    return;
  }
  d.write("a.bin", std::string(1 << 20, 'a'));
  auto st = sparkctl({"--json", "cache-stat", d.path()});
  REQUIRE(st.rc == 0);
  auto sj = json::parse(st.out);
  CHECK(sj["resident_bytes"].get<uint64_t>() == (1u << 20));  // just written: cached
  auto ev = sparkctl({"--json", "evict", "--local", d.path()});
  REQUIRE(ev.rc == 0);
  auto ej = json::parse(ev.out);
  CHECK(ej["bytes_before"].get<uint64_t>() == (1u << 20));
  CHECK(ej["bytes_after"].get<uint64_t>() == 0);
  CHECK(ej.contains("mem_free_before"));
  CHECK(ej.contains("mem_available_after"));
  auto st2 = sparkctl({"cache-stat", "-v", d.path()});
  CHECK(st2.rc == 0);
  CHECK(st2.out.find("0.0%") != std::string::npos);
  CHECK(sparkctl({"cache-stat", d / "missing"}).rc == exit_code(Errc::not_found));
}
