// sparkctl manifest DIR [--verify [--quick]] [--sha256] [--chunk-size SIZE]
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_stage.h"
#include "core/strings.h"

namespace spark::cli {

Result<Manifest> current_manifest(const std::string& dir, uint64_t chunk_size, bool* rebuilt) {
  if (rebuilt) *rebuilt = false;
  if (auto old = read_manifest(dir); old && old->chunk_size == chunk_size) {
    auto v = verify_manifest(dir, *old, /*deep=*/false);
    bool fresh = v.ok && v.bytes_hashed == 0;
    for (const auto& p : v.problems)
      if (p.status == "extra") fresh = false;
    if (fresh) return old;
  } else if (!old && old.error().code == Errc::integrity) {
    return old.error();  // a hostile or damaged manifest is reported, not silently replaced
  }
  ManifestOptions mo;
  mo.chunk_size = chunk_size;
  auto m = build_manifest(dir, mo);
  if (!m) return m;
  SPARK_TRY(write_manifest(dir, *m));
  if (rebuilt) *rebuilt = true;
  return m;
}

namespace {

int verify(Context& ctx, const std::string& dir, bool quick) {
  auto m = read_manifest(dir);
  if (!m) return ctx.fail(m.error());
  auto r = verify_manifest(dir, *m, !quick);
  if (ctx.opts.json) {
    nlohmann::json j = {{"dir", dir},           {"digest", r.digest},
                        {"ok", r.ok},           {"files", r.files},
                        {"bytes", r.bytes},     {"bytes_hashed", r.bytes_hashed},
                        {"seconds", r.seconds}, {"deep", !quick}};
    j["problems"] = nlohmann::json::array();
    for (const auto& p : r.problems)
      j["problems"].push_back({{"path", p.path}, {"status", p.status}, {"detail", p.detail}});
    *ctx.out << j.dump(2) << "\n";
  } else {
    for (const auto& p : r.problems)
      *ctx.out << fmt::format("{:<10} {}  {}\n", p.status, p.path, p.detail);
    *ctx.out << fmt::format("{}: {} ({} files, {}, {} hashed in {:.1f} s, digest {})\n", dir,
                            r.ok ? "OK" : "MISMATCH", r.files, format_size(r.bytes),
                            format_size(r.bytes_hashed), r.seconds, r.digest);
  }
  return r.ok ? 0 : exit_code(Errc::integrity);
}

}  // namespace

int cmd_manifest(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("manifest options");
  desc.add_options()("dir", po::value<std::string>(), "model directory")(
      "verify", "check the directory against its manifest (rehashes every file)")(
      "quick", "with --verify: trust files whose size and mtime match")(
      "sha256", "also record sha256 per file (compare with the hub's LFS ids)")(
      "chunk-size", po::value<std::string>()->default_value("64MiB"), "resume/verification unit");
  po::positional_options_description pos;
  pos.add("dir", 1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "manifest", "manifest DIR [--verify [--quick]] [--sha256]", desc,
                           args, vm, &pos))
    return *rc;
  if (!vm.count("dir"))
    return ctx.fail(
        make_error(Errc::usage, "manifest: name the model directory (sparkctl manifest DIR)"));
  std::string dir = vm["dir"].as<std::string>();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (vm.count("verify")) return verify(ctx, dir, vm.count("quick") > 0);
  std::string why;
  auto cs = parse_size(vm["chunk-size"].as<std::string>(), &why);
  if (!cs || *cs < 4096 || *cs > (1ull << 30))
    return ctx.fail(make_error(
        Errc::usage,
        fmt::format("manifest: --chunk-size must be 4KiB..1GiB{}", why.empty() ? "" : ": " + why)));
  ManifestOptions mo;
  mo.chunk_size = *cs;
  mo.sha256 = vm.count("sha256") > 0;
  bool tty = !ctx.opts.json && ::isatty(2);
  if (tty)
    mo.progress = [&](const std::string& p, uint64_t done, uint64_t total) {
      *ctx.err << fmt::format("\r\033[K{} / {}  {}", format_size(done), format_size(total), p)
               << std::flush;
    };
  auto t0 = std::chrono::steady_clock::now();
  auto m = build_manifest(dir, mo);
  if (tty) *ctx.err << "\r\033[K";
  if (!m) return ctx.fail(m.error());
  if (auto s = write_manifest(dir, *m); !s) return ctx.fail(s.error());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double rate = secs > 0 ? static_cast<double>(m->total_bytes()) / secs : 0;
  if (ctx.opts.json) {
    *ctx.out << nlohmann::json{{"dir", dir},
                               {"manifest", dir + "/" + kManifestName},
                               {"digest", m->digest()},
                               {"files", m->files.size()},
                               {"bytes", m->total_bytes()},
                               {"chunk_size", m->chunk_size},
                               {"sha256", mo.sha256},
                               {"seconds", secs},
                               {"bytes_per_second", rate}}
                    .dump(2)
             << "\n";
  } else {
    *ctx.out << fmt::format("{}/{}: {} files, {}, digest {} ({:.1f} s, {}/s)\n", dir, kManifestName,
                            m->files.size(), format_size(m->total_bytes()), m->digest(), secs,
                            format_size(static_cast<uint64_t>(rate)));
  }
  return 0;
}

}  // namespace spark::cli
