#include "env/known_bad.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "env/sysroot.h"

// Generated from env/known_bad.json at configure time (env/CMakeLists.txt).
extern "C" const unsigned char spark_known_bad_json[];
extern "C" const unsigned long spark_known_bad_json_size;

namespace spark::env {

using nlohmann::json;

std::optional<std::vector<long>> version_numbers(const std::string& v) {
  std::vector<long> out;
  size_t i = 0;
  while (i < v.size() && v[i] >= '0' && v[i] <= '9') {
    long n = 0;
    size_t start = i;
    while (i < v.size() && v[i] >= '0' && v[i] <= '9' && i - start < 12)
      n = n * 10 + (v[i++] - '0');
    out.push_back(n);
    if (i + 1 < v.size() && v[i] == '.' && v[i + 1] >= '0' && v[i + 1] <= '9')
      ++i;
    else
      break;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

namespace {

int compare_versions(const std::vector<long>& a, const std::vector<long>& b) {
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    long x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    if (x != y) return x < y ? -1 : 1;
  }
  return 0;
}

}  // namespace

Result<bool> version_matches(const std::string& version, const std::string& range) {
  auto v = version_numbers(version);
  bool all = true;
  auto parts = split_list(range, ',');
  if (parts.empty()) return make_error(Errc::config, "empty version range");
  for (const auto& raw : parts) {
    std::string p(trim(raw));
    if (p == "*") continue;
    std::string op;
    for (const char* o : {">=", "<=", "==", ">", "<", "="})
      if (starts_with(p, o)) {
        op = o;
        break;
      }
    if (op.empty())
      return make_error(Errc::config,
                        fmt::format("'{}' is not a comparison (>=, >, <=, <, = or *)", p));
    std::string rhs(trim(std::string_view(p).substr(op.size())));
    auto bound = version_numbers(rhs);
    if (!bound || rhs.find_first_not_of("0123456789.") != std::string::npos)
      return make_error(Errc::config, fmt::format("'{}': '{}' is not a dotted version", p, rhs));
    if (!v) {
      all = false;
      continue;
    }
    int c = compare_versions(*v, *bound);
    bool ok = op == ">="   ? c >= 0
              : op == "<=" ? c <= 0
              : op == ">"  ? c > 0
              : op == "<"  ? c < 0
                           : c == 0;
    all = all && ok;
  }
  return all && v.has_value();
}

Result<KnownBadList> parse_known_bad(const std::string& text, const std::string& origin) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return make_error(Errc::config, fmt::format("known-bad list {}: not a JSON object", origin));
  if (j.value("schema", 0) != 1)
    return make_error(Errc::config, fmt::format("known-bad list {}: schema must be 1", origin));
  if (!j.contains("entries") || !j["entries"].is_array())
    return make_error(Errc::config, fmt::format("known-bad list {}: no \"entries\" array", origin));
  KnownBadList list;
  list.origin = origin;
  int i = 0;
  for (const auto& e : j["entries"]) {
    ++i;
    auto bad = [&](const std::string& what) {
      return make_error(Errc::config,
                        fmt::format("known-bad list {}: entry {}{}: {}", origin, i,
                                    e.is_object() && e.contains("id") && e["id"].is_string()
                                        ? " (" + e["id"].get<std::string>() + ")"
                                        : "",
                                    what));
    };
    if (!e.is_object()) return bad("not an object");
    auto str = [&](const char* k) -> std::optional<std::string> {
      if (!e.contains(k)) return std::string();
      if (!e[k].is_string()) return std::nullopt;
      return e[k].get<std::string>();
    };
    KnownBadEntry k;
    for (auto [key, out] :
         {std::pair{"id", &k.id}, std::pair{"component", &k.component},
          std::pair{"versions", &k.versions}, std::pair{"unless_cmdline", &k.unless_cmdline},
          std::pair{"symptom", &k.symptom}, std::pair{"fix", &k.fix}}) {
      auto v = str(key);
      if (!v) return bad(fmt::format("\"{}\" must be a string", key));
      *out = escape_invalid_utf8(*v);
    }
    for (auto [key, val] : {std::pair{"id", &k.id}, std::pair{"component", &k.component},
                            std::pair{"versions", &k.versions}, std::pair{"symptom", &k.symptom},
                            std::pair{"fix", &k.fix}})
      if (val->empty()) return bad(fmt::format("\"{}\" is required", key));
    if (k.component != "kernel" && k.component != "driver" && k.component != "nccl" &&
        k.component != "firmware")
      return bad(
          fmt::format("component '{}' is not kernel, driver, nccl or firmware", k.component));
    if (auto r = version_matches("0", k.versions); !r)
      return bad(fmt::format("versions: {}", r.error().message));
    auto needs = str("needs");
    if (!needs || (!needs->empty() && *needs != "rdma")) return bad("\"needs\" must be \"rdma\"");
    k.needs_rdma = *needs == "rdma";
    auto verdict = str("verdict");
    if (!verdict || (*verdict != "FAIL" && *verdict != "WARN"))
      return bad("\"verdict\" must be FAIL or WARN");
    k.verdict = *verdict == "FAIL" ? Verdict::fail : Verdict::warn;
    if (!e.contains("sources") || !e["sources"].is_array() || e["sources"].empty())
      return bad("\"sources\" must list at least one source");
    for (const auto& s : e["sources"]) {
      if (!s.is_string() || s.get<std::string>().empty())
        return bad("every source must be a non-empty string");
      k.sources.push_back(escape_invalid_utf8(s.get<std::string>()));
    }
    for (const auto& prev : list.entries)
      if (prev.id == k.id) return bad(fmt::format("id '{}' is used twice", k.id));
    list.entries.push_back(std::move(k));
  }
  return list;
}

const KnownBadList& builtin_known_bad() {
  static const KnownBadList list = [] {
    std::string text(reinterpret_cast<const char*>(spark_known_bad_json),
                     static_cast<size_t>(spark_known_bad_json_size));
    auto r = parse_known_bad(text, "built-in");
    // tests/env/known_bad_test.cc parses the same file, so a broken list fails the build's
    // tests; at run time it degrades to an empty list rather than crashing preflight.
    return r ? *r : KnownBadList{{}, "built-in (" + r.error().message + ")"};
  }();
  return list;
}

Result<KnownBadList> load_known_bad(const std::string& extra_file) {
  KnownBadList list = builtin_known_bad();
  if (extra_file.empty()) return list;
  auto text = read_file_bounded(extra_file, kJsonReadCap);
  if (!text)
    return make_error(Errc::config, fmt::format("KNOWN_BAD_FILE: {}", text.error().message));
  auto extra = parse_known_bad(*text, extra_file);
  if (!extra) return extra.error();
  for (auto& e : extra->entries) {
    for (const auto& b : list.entries)
      if (b.id == e.id)
        return make_error(
            Errc::config,
            fmt::format("known-bad list {}: id '{}' is already built in", extra_file, e.id));
    list.entries.push_back(std::move(e));
  }
  list.origin = "built-in + " + extra_file;
  return list;
}

namespace {

bool has_word(const std::string& cmdline, const std::string& word) {
  for (const auto& w : split_list(cmdline, ' '))
    if (w == word) return true;
  return false;
}

void check_component(const KnownBadList& list, const SoftwareVersions& sw, const std::string& node,
                     const std::string& component, const std::string& subject,
                     const std::string& version, std::vector<CheckResult>& out) {
  std::string what = fmt::format("{} {}", component, version);
  if (!version_numbers(version)) {
    out.push_back({node, "sw.known_bad", subject, Verdict::skip,
                   fmt::format("{} version unknown{}", component,
                               version.empty() ? "" : fmt::format(" ('{}')", version)),
                   ""});
    return;
  }
  int checked = 0;
  std::vector<std::string> defused;
  bool hit = false;
  for (const auto& e : list.entries) {
    if (e.component != component) continue;
    ++checked;
    auto m = version_matches(version, e.versions);
    if (!m || !*m) continue;
    if (e.needs_rdma && !sw.rdma) {
      defused.push_back(fmt::format("{} applies only with RDMA", e.id));
      continue;
    }
    if (!e.unless_cmdline.empty() && has_word(sw.cmdline, e.unless_cmdline)) {
      defused.push_back(
          fmt::format("{} is on the kernel command line ({})", e.unless_cmdline, e.id));
      continue;
    }
    hit = true;
    std::string cond =
        e.unless_cmdline.empty()
            ? ""
            : fmt::format(" without {} on the kernel command line", e.unless_cmdline);
    out.push_back({node, "sw.known_bad", subject, e.verdict,
                   fmt::format("{}{} is known bad ({} {}): {} [{}; source: {}]", what, cond,
                               component, e.versions, e.symptom, e.id, e.sources.front()),
                   e.fix});
  }
  if (!hit)
    out.push_back({node, "sw.known_bad", subject, Verdict::pass,
                   fmt::format("{}: no known-bad entry applies ({} {} entr{} in the {} list{}{})",
                               what, checked, component, checked == 1 ? "y" : "ies", list.origin,
                               defused.empty() ? "" : "; ", join(defused, "; ")),
                   ""});
}

}  // namespace

std::vector<CheckResult> known_bad_checks(const KnownBadList& list, const SoftwareVersions& sw,
                                          const std::string& node) {
  std::vector<CheckResult> out;
  check_component(list, sw, node, "kernel", "kernel", sw.kernel, out);
  check_component(list, sw, node, "driver", "driver", sw.driver, out);
  check_component(list, sw, node, "nccl", "nccl", sw.nccl, out);
  for (const auto& [hca, fw] : sw.firmware)
    check_component(list, sw, node, "firmware", "firmware " + hca, fw, out);
  return out;
}

}  // namespace spark::env
