#include "cli/bundle.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "cli/cmd_preflight.h"
#include "cli/cmd_version.h"
#include "cli/engine_pin.h"
#include "cli/history_view.h"
#include "cli/node_exec.h"
#include "cli/node_ops.h"
#include "cli/ring_state.h"
#include "core/base64.h"
#include "core/manifest.h"
#include "core/process.h"
#include "core/redact.h"
#include "core/strings.h"
#include "env/capture.h"
#include "env/facts.h"
#include "env/gpu_throttle.h"
#include "env/nvml.h"
#include "env/preflight.h"
#include "env/rdma.h"
#include "env/sysroot.h"

namespace spark::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

ProcessSpec spec(std::vector<std::string> argv,
                 std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  ProcessSpec p;
  p.argv = std::move(argv);
  p.timeout = timeout;
  return p;
}

// A removed-on-exit scratch directory.
struct ScratchDir {
  std::string path;
  ScratchDir() {
    std::string t = "/tmp/sparkctl-bundle-XXXXXX";
    if (::mkdtemp(t.data())) path = t;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

// The last `lines` lines of a file, reading at most its last `cap` bytes.
std::optional<std::string> tail_file(const std::string& path, int lines, size_t cap = 4u << 20) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return std::nullopt;
  }
  off_t size = st.st_size;
  off_t from = size > static_cast<off_t>(cap) ? size - static_cast<off_t>(cap) : 0;
  std::string buf(static_cast<size_t>(size - from), '\0');
  ssize_t n = ::pread(fd, buf.data(), buf.size(), from);
  ::close(fd);
  if (n < 0) return std::nullopt;
  buf.resize(static_cast<size_t>(n));
  if (lines <= 0) return std::string();
  // Count back `lines` line ends (a last line without its newline counts as one).
  size_t at = buf.size();
  if (at > 0 && buf[at - 1] == '\n') --at;
  int seen = 0;
  while (at > 0) {
    if (buf[at - 1] == '\n' && ++seen == lines) break;
    --at;
  }
  return buf.substr(at);
}

std::string first_line(const std::string& path) {
  auto t = read_file(path);
  if (!t) return "";
  return std::string(trim(t->substr(0, t->find('\n'))));
}

std::string os_release() {
  auto t = read_file("/etc/os-release").value_or("");
  for (const auto& line : split_list(t, '\n'))
    if (starts_with(line, "PRETTY_NAME=")) {
      std::string v = line.substr(12);
      if (v.size() >= 2 && v.front() == '"') v = v.substr(1, v.size() - 2);
      return v;
    }
  return "";
}

// The kernel command line without what differs by design between hosts.
std::string cmdline_for_diff(const std::string& cmdline) {
  std::vector<std::string> keep;
  for (const auto& w : split_list(cmdline, ' ')) {
    if (w.empty() || starts_with(w, "BOOT_IMAGE=") || starts_with(w, "root=") ||
        starts_with(w, "resume=") || starts_with(w, "cryptdevice="))
      continue;
    keep.push_back(w);
  }
  return join(keep, " ");
}

json engine_versions(const RingConfig& cfg, const std::vector<std::string>& secrets) {
  json e{{"engine", cfg.get("ENGINE")}};
  if (cfg.get("ENGINE") != "exec") return e;
  e["command"] = redact(cfg.get("ENGINE_EXEC"), secrets);
  if (auto img = image_of_command(cfg.get("ENGINE_EXEC")))
    e["image"] = {
        {"runtime", img->runtime}, {"ref", img->ref}, {"id", img->id}, {"digest", img->digest}};
  json bins = json::array();
  for (const auto& b : command_binaries(cfg.get("ENGINE_EXEC"))) {
    auto h = hash_file(b, uint64_t{1} << 30, false);
    std::error_code ec;
    auto size = fs::file_size(b, ec);
    bins.push_back(json{{"path", b},
                        {"xxh3", h ? h->xxh3 : std::string()},
                        {"size", ec ? uint64_t{0} : static_cast<uint64_t>(size)}});
  }
  e["binaries"] = bins;
  return e;
}

json kernel_log(int lines) {
  // dmesg needs CAP_SYSLOG where kernel.dmesg_restrict=1; journalctl -k needs the journal.
  std::vector<std::pair<std::string, std::vector<std::string>>> tries = {
      {"dmesg", {"dmesg", "-T"}},
      {"journalctl -k", {"journalctl", "-k", "-b", "--no-pager", "-n", std::to_string(lines)}},
  };
  std::vector<std::string> why;
  for (const auto& [name, argv] : tries) {
    auto r = run_process(spec(argv));
    if (r && r->success() && !trim(r->out).empty()) {
      auto parts = split_list(r->out, '\n');
      size_t from = parts.size() > static_cast<size_t>(lines) ? parts.size() - lines : 0;
      std::vector<std::string> t(parts.begin() + static_cast<long>(from), parts.end());
      return {{"source", name}, {"text", join(t, "\n") + "\n"}};
    }
    why.push_back(fmt::format("{}: {}", name,
                              r ? std::string(trim(r->err)).substr(0, 200) : r.error().message));
  }
  for (const char* f : {"/var/log/kern.log", "/var/log/messages"})
    if (auto t = tail_file(f, lines)) return {{"source", f}, {"text", *t}};
  return {{"source", ""},
          {"text", ""},
          {"error", "kernel log not readable: " + join(why, "; ") +
                        " (run the bundle as root, or add the user to group adm/systemd-journal)"}};
}

json versions_here(const RingConfig& cfg, const std::vector<std::string>& secrets) {
  json v;
  struct utsname u {};
  ::uname(&u);
  v["kernel"] = {{"release", u.release}, {"version", u.version}, {"machine", u.machine}};
  v["cmdline"] = first_line("/proc/cmdline");
  v["os"] = os_release();
  auto ver = collect_version(true);
  v["sparkctl"] = ver.sparkctl;
  v["gpu"] = to_json(ver);
  v["nvidia_driver"] = ver.gpu.kernel_module_version;
  v["cuda_driver"] = env::cuda_version_text(ver.gpu.driver_api_version);
  v["nccl"] = {{"version", env::nccl_version_text(ver.gpu.nccl_version_code)},
               {"library", ver.gpu.nccl_library}};
  std::error_code ec;
  if (!ver.gpu.nccl_library.empty())
    v["nccl"]["resolved"] = fs::canonical(ver.gpu.nccl_library, ec).string();
  json fw = json::object();
  env::Sysroot root("/");
  for (const auto& h : env::list_hcas(root)) {
    fw[h] = {{"fw_ver", first_line("/sys/class/infiniband/" + h + "/fw_ver")},
             {"board_id", first_line("/sys/class/infiniband/" + h + "/board_id")}};
  }
  v["hca_firmware"] = fw;
  json bios = json::object();
  for (const char* f :
       {"bios_vendor", "bios_version", "bios_date", "board_name", "product_name", "sys_vendor"})
    bios[f] = first_line(std::string("/sys/class/dmi/id/") + f);
  v["bios"] = bios;
  v["engine"] = engine_versions(cfg, secrets);
  v["nvml"] = env::to_json(env::read_nvml());  // clocks, power, throttle reasons now
  return v;
}

Result<std::string> capture_archive(const RingConfig& cfg, int node) {
  ScratchDir tmp;
  if (tmp.path.empty()) return make_error(Errc::io, "mkdtemp /tmp failed");
  // No load: the ring may be serving on these GPUs.
  auto sum = env::capture_node_tree(&cfg, node, "/", tmp.path + "/tree", false);
  if (!sum) return sum.error();
  auto r = run_process(
      spec({"tar", "-czSf", tmp.path + "/capture.tar.gz", "-C", tmp.path + "/tree", "."},
           std::chrono::seconds(120)));
  if (!r || !r->success())
    return make_error(Errc::io, fmt::format("tar of the capture failed: {}",
                                            r ? std::string(trim(r->err)) : r.error().message));
  auto bytes = read_file(tmp.path + "/capture.tar.gz");
  if (!bytes) return make_error(Errc::io, "cannot read the capture archive back");
  return *bytes;
}

std::string str_at(const json& j, const std::vector<std::string>& path) {
  const json* p = &j;
  for (const auto& k : path) {
    if (!p->is_object() || !p->contains(k)) return "";
    p = &(*p)[k];
  }
  if (p->is_string()) return p->get<std::string>();
  if (p->is_null()) return "";
  return p->dump();
}

}  // namespace

std::vector<std::string> known_secrets(const RingConfig& cfg) {
  std::vector<std::string> out;
  for (const auto& [k, s] : cfg.settings) {
    if (s.value.empty()) continue;
    if (is_secret_name(k)) out.push_back(s.value);
    for (auto& f : find_secrets(s.value)) out.push_back(std::move(f));
  }
  if (!cfg.get("API_KEY_FILE").empty())
    if (auto key = read_api_key_file(cfg.get("API_KEY_FILE")); key.ok()) out.push_back(*key);
  return out;
}

std::string redacted_config_text(const RingConfig& cfg) {
  RingConfig copy = cfg;
  auto secrets = known_secrets(cfg);
  for (auto& [k, s] : copy.settings) {
    if (s.value.empty()) continue;
    s.value = is_secret_name(k) ? std::string(kRedacted) : redact(s.value, secrets);
  }
  return config_wire_text(copy);
}

json collect_node_bundle(const RingConfig& cfg, int node, const BundleOptions& opt) {
  auto secrets = known_secrets(cfg);
  const auto& n = cfg.nodes.at(static_cast<size_t>(node));
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  json doc{{"schema", 1},
           {"node", n.name},
           {"index", node},
           {"hostname", host},
           {"boot_id", first_line("/proc/sys/kernel/random/boot_id")},
           {"collected_ms", env::now_ms()}};
  doc["versions"] = versions_here(cfg, secrets);
  // gpu.throttle without its load (the GPUs may be serving): NVML's view as they run now.
  env::CheckFilter all;
  all.skip = {"gpu.throttle"};
  auto rep = env::run_node_checks(cfg, node, env::Sysroot("/"), all, false);
  env::ThrottleOptions quiet;
  quiet.gpus = n.gpus;
  for (auto& row : env::throttle_checks(n.name, env::measure_gpu_throttle(quiet)))
    rep.checks.push_back(std::move(row));
  doc["preflight"] = env::report_to_json(rep);
  doc["identity"] = rep.identity;
  auto dirs = node_dirs(cfg);
  json logs = json::object();
  for (int r : ranks_of_node(cfg, node))
    for (const auto& f : {fmt::format("sparkd-{}.log", r), fmt::format("sparkd-{}.out", r),
                          fmt::format("engine-rank{}.log", r)})
      if (auto t = tail_file(dirs.log + "/" + f, opt.log_lines)) logs[f] = redact(*t, secrets);
  doc["logs"] = logs;
  auto kl = kernel_log(opt.kernel_lines);
  kl["text"] = redact(kl.value("text", ""), secrets);
  doc["kernel_log"] = kl;
  doc["history"] = history_here(cfg, node, 0);
  if (auto cap = capture_archive(cfg, node); cap.ok())
    doc["capture"] = base64_encode(*cap);
  else
    doc["capture_error"] = cap.error().message;
  return doc;
}

std::vector<FieldDiff> diff_nodes(const std::vector<json>& docs) {
  std::vector<std::pair<std::string, std::function<std::string(const json&)>>> fields = {
      {"kernel",
       [](const json& d) {
         return str_at(d, {"versions", "kernel", "release"});
       }},
      {"kernel_cmdline",
       [](const json& d) {
         return cmdline_for_diff(str_at(d, {"versions", "cmdline"}));
       }},
      {"os",
       [](const json& d) {
         return str_at(d, {"versions", "os"});
       }},
      {"machine",
       [](const json& d) {
         return str_at(d, {"versions", "kernel", "machine"});
       }},
      {"nccl_build",
       [](const json& d) {
         return str_at(d, {"versions", "nccl", "resolved"});
       }},
      {"hca_firmware",
       [](const json& d) {
         std::vector<std::string> v;
         auto fw = d.contains("versions") ? d["versions"].value("hca_firmware", json::object())
                                          : json::object();
         for (auto it = fw.begin(); it != fw.end(); ++it)
           v.push_back(it.key() + " " + it.value().value("fw_ver", ""));
         return join(v, ", ");
       }},
      {"bios",
       [](const json& d) {
         return str_at(d, {"versions", "bios", "bios_version"});
       }},
      {"engine_image",
       [](const json& d) {
         auto e = d.contains("versions") ? d["versions"].value("engine", json::object())
                                         : json::object();
         return e.contains("image") ? e["image"].value("ref", "") + " " + e["image"].value("id", "")
                                    : std::string();
       }},
      {"engine_binaries",
       [](const json& d) {
         std::vector<std::string> v;
         auto e = d.contains("versions") ? d["versions"].value("engine", json::object())
                                         : json::object();
         for (const auto& b : e.value("binaries", json::array()))
           v.push_back(b.value("path", "") + " " + b.value("xxh3", "").substr(0, 16));
         return join(v, ", ");
       }},
  };
  for (const char* f : {"sparkctl_version", "sparkd_version", "nvidia_driver", "cuda_driver",
                        "nccl_version", "nccl_path", "config_digest", "manifest_digest"}) {
    std::string key = f;
    fields.emplace_back(key, [key](const json& d) { return str_at(d, {"identity", key}); });
  }
  std::vector<FieldDiff> out;
  for (const auto& [name, get] : fields) {
    FieldDiff fd{name, {}, false};
    for (const auto& d : docs) fd.values.push_back(get(d));
    for (const auto& v : fd.values)
      if (v != fd.values.front()) fd.differs = true;
    out.push_back(std::move(fd));
  }
  return out;
}

std::string summary_text(const RingConfig& cfg, const BundleReport& r, const std::string& when) {
  std::string s = fmt::format("sparkctl bundle of ring {} ({} node(s)), {}\n\n",
                              cfg.get("RING_NAME"), cfg.nodes.size(), when);
  s += "nodes:\n";
  for (const auto& n : r.nodes) s += fmt::format("  {:<14} bundled\n", n);
  for (const auto& m : r.missing) s += fmt::format("  MISSING {}\n", m);
  if (!r.engine_current.empty() || !r.engine_last_good.empty())
    s += fmt::format("\nengine started last: {}\nlast good engine:    {}\n",
                     r.engine_current.empty() ? "-" : r.engine_current,
                     r.engine_last_good.empty() ? "-" : r.engine_last_good);
  s += fmt::format("\nfields that must match across the ring ({} node(s) answered):\n",
                   r.nodes.size());
  for (const auto& d : r.diff) {
    if (!d.differs) {
      s += fmt::format("  {:<18} same   {}\n", d.field,
                       d.values.empty() || d.values[0].empty() ? "(none)" : d.values[0]);
      continue;
    }
    std::vector<std::string> per;
    for (size_t k = 0; k < d.values.size() && k < r.nodes.size(); ++k)
      per.push_back(fmt::format("{} {}", r.nodes[k], d.values[k].empty() ? "(none)" : d.values[k]));
    s += fmt::format("  {:<18} DIFFERS {}\n", d.field, join(per, "; "));
  }
  s += "\nper node under nodes/NODE/: versions.json, preflight.json, capture.tar.gz (replay: "
       "sparkctl --config cluster.env preflight --local --node N --sysroot capture.tar.gz), "
       "logs/, kernel.log, history.json; cluster.env is the resolved cluster file with "
       "secrets redacted\n";
  return s;
}

json to_json(const BundleReport& r) {
  json diff = json::array();
  for (const auto& d : r.diff)
    diff.push_back({{"field", d.field}, {"values", d.values}, {"differs", d.differs}});
  json j{{"archive", r.archive}, {"nodes", r.nodes}, {"missing", r.missing}, {"diff", diff}};
  if (r.error)
    j["error"] = {{"code", std::string(errc_name(r.error->code))}, {"message", r.error->message}};
  return j;
}

BundleReport make_bundle(const RingConfig& cfg, const BundleOptions& opt) {
  BundleReport rep;
  auto t = std::time(nullptr);
  struct tm tm {};
  ::gmtime_r(&t, &tm);
  char stamp[32], when[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::string base = fmt::format("sparkctl-bundle-{}-{}", cfg.get("RING_NAME"), stamp);
  rep.archive = opt.out.empty() ? base + ".tar.gz" : opt.out;

  std::vector<int> all;
  std::vector<std::string> commands;
  for (const auto& n : cfg.nodes) {
    all.push_back(n.index);
    commands.push_back(fmt::format("{} --config - bundle --local --node {} --log-lines {}",
                                   shell_quote(opt.sparkctl_bin), n.index, opt.log_lines));
  }
  auto runs = run_on_nodes(cfg, jobs_on(all, commands, config_wire_text(cfg)), opt.timeout);

  ScratchDir tmp;
  if (tmp.path.empty()) {
    rep.error = make_error(Errc::io, "bundle: mkdtemp under /tmp failed");
    rep.archive.clear();
    return rep;
  }
  const std::string top = tmp.path + "/" + base;
  std::vector<std::string> members;  // in archive order, SUMMARY.txt first
  std::optional<Error> write_error;
  auto secrets = known_secrets(cfg);
  auto put = [&](const std::string& rel, const std::string& data, bool scrub = true) {
    std::string path = top + "/" + rel;
    std::error_code ec;
    fs::create_directories(fs::path(path).parent_path(), ec);
    std::string why;
    if (!write_file_atomic(path, scrub ? redact(data, secrets) : data, &why) && !write_error)
      write_error = make_error(Errc::io, fmt::format("bundle: {}: {}", path, why));
    members.push_back(base + "/" + rel);
  };
  auto dump = [](const json& j) {
    return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  };
  std::vector<json> docs;
  for (const auto& run : runs) {
    std::string dir = "nodes/" + run.node + "/";
    std::string why;
    json doc;
    if (!run.ok()) {
      why = run.error->message;
    } else if (run.exit_status != 0) {
      why = fmt::format("`sparkctl bundle --local` exited {}: {}", run.exit_status,
                        std::string(trim(run.err)).substr(0, 2000));
    } else {
      doc = json::parse(run.out, nullptr, false);
      if (doc.is_discarded() || !doc.is_object())
        why =
            "its answer is not a bundle document (a different sparkctl on that node? set "
            "SPARKCTL_BIN)";
    }
    if (!why.empty()) {
      rep.missing.push_back(fmt::format("{}: {}", run.node, why));
      put(dir + "ERROR.txt", fmt::format("{} gave nothing to the bundle: {}\n", run.node, why));
      continue;
    }
    try {
      if (!doc["logs"].is_object()) doc["logs"] = json::object();
      if (!doc["kernel_log"].is_object()) doc["kernel_log"] = json::object();
      for (auto it = doc["logs"].begin(); it != doc["logs"].end(); ++it)
        if (!it.value().is_string()) it.value() = it.value().dump();
      if (doc.contains("capture") && !doc["capture"].is_string()) doc.erase("capture");
    } catch (const json::exception& e) {
      why = std::string("its answer is malformed: ") + e.what();
      rep.missing.push_back(fmt::format("{}: {}", run.node, why));
      put(dir + "ERROR.txt", fmt::format("{} gave nothing to the bundle: {}\n", run.node, why));
      continue;
    }
    rep.nodes.push_back(run.node);
    put(dir + "versions.json", dump(doc["versions"]));
    put(dir + "preflight.json", dump(doc["preflight"]));
    for (auto it = doc["logs"].begin(); it != doc["logs"].end(); ++it)
      put(dir + "logs/" + fs::path(it.key()).filename().string(), it.value().get<std::string>());
    const auto& kl = doc["kernel_log"];
    put(dir + "kernel.log",
        kl.contains("error")
            ? kl.value("error", "") + "\n"
            : fmt::format("# from {}\n{}", kl.value("source", ""), kl.value("text", "")));
    if (doc.contains("history")) put(dir + "history.json", dump(doc["history"]));
    if (doc.contains("capture")) {
      auto bytes = base64_decode(doc["capture"].get<std::string>());
      if (bytes) put(dir + "capture.tar.gz", *bytes, false);
      doc.erase("capture");
      if (!bytes) doc["capture_error"] = "the capture did not arrive whole (bad base64)";
    }
    docs.push_back(std::move(doc));
  }
  rep.diff = diff_nodes(docs);
  // What the ring runs (start's record), beside what the cluster file's command names now.
  std::string state = head_state_dir(cfg);
  json sets = json::object();
  for (const char* which : {"current", "last-good"}) {
    auto set = read_engine_set(state, which);
    std::string& line = std::string(which) == "current" ? rep.engine_current : rep.engine_last_good;
    if (!set) {
      sets[which] = nullptr;
      continue;
    }
    line = describe_set(*set);
    auto j = to_json(*set);
    j.erase("config_text");  // may hold secrets; the redacted cluster.env is beside it
    j["command"] = redact(set->command, secrets);
    sets[which] = j;
  }

  // SUMMARY.txt and bundle.json first in the archive; they are written last.
  std::vector<std::string> node_members = std::move(members);
  members.clear();
  put("SUMMARY.txt", summary_text(cfg, rep, when));
  json nodes_json = json::array();
  for (const auto& d : docs)
    nodes_json.push_back({{"node", d.value("node", "")},
                          {"hostname", d.value("hostname", "")},
                          {"boot_id", d.value("boot_id", "")},
                          {"collected_ms", d.value("collected_ms", int64_t{0})},
                          {"capture_error", d.value("capture_error", "")}});
  json bj = to_json(rep);
  bj["schema"] = 1;
  bj["ring"] = cfg.get("RING_NAME");
  bj["created"] = when;
  bj["node_details"] = nodes_json;
  bj["engine_sets"] = sets;
  bj.erase("archive");
  put("bundle.json", dump(bj));
  put("cluster.env", redacted_config_text(cfg));
  auto head = collect_version(false);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  put("head.json", dump({{"hostname", host}, {"sparkctl", head.sparkctl}}));
  members.insert(members.end(), node_members.begin(), node_members.end());

  if (write_error) {
    rep.error = write_error;
    rep.archive.clear();
    return rep;
  }
  std::string list;
  for (const auto& m : members) list += m + "\n";
  std::string why;
  write_file_atomic(tmp.path + "/members", list, &why);
  // Under a temporary name, renamed when complete: never a half archive under its name.
  std::string part = fmt::format("{}.part.{}", rep.archive, ::getpid());
  auto r = run_process(
      spec({"tar", "-czf", part, "-C", tmp.path, "--no-recursion", "-T", tmp.path + "/members"},
           std::chrono::seconds(300)));
  std::error_code ec;
  if (!r || !r->success()) {
    fs::remove(part, ec);
    rep.error =
        make_error(Errc::io, fmt::format("{}: tar failed: {}", rep.archive,
                                         r ? std::string(trim(r->err)) : r.error().message));
    rep.archive.clear();
    return rep;
  }
  fs::rename(part, rep.archive, ec);
  if (ec) {
    fs::remove(part, ec);
    rep.error = make_error(Errc::io, fmt::format("{}: {}", rep.archive, ec.message()));
    rep.archive.clear();
  }
  return rep;
}

}  // namespace spark::cli
