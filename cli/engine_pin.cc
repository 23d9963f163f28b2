#include "cli/engine_pin.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cctype>
#include <filesystem>

#include "cli/cmd_preflight.h"
#include "cli/node_exec.h"
#include "core/manifest.h"
#include "core/process.h"
#include "core/redact.h"
#include "core/strings.h"

namespace spark::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

ProcessSpec spec(std::vector<std::string> argv) {
  ProcessSpec p;
  p.argv = std::move(argv);
  p.timeout = std::chrono::seconds(20);
  return p;
}

// Shell-ish words of a command line (quotes removed; no expansion).
std::vector<std::string> words_of(const std::string& command) {
  std::vector<std::string> out;
  std::string w;
  char quote = 0;
  bool in = false;
  for (char c : command) {
    if (quote) {
      if (c == quote)
        quote = 0;
      else
        w += c;
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c;
      in = true;
      continue;
    }
    if (std::isspace(static_cast<unsigned char>(c)) || c == ';' || c == '|' || c == '&' ||
        c == '(' || c == ')') {
      if (in) out.push_back(w);
      w.clear();
      in = false;
      continue;
    }
    w += c;
    in = true;
  }
  if (in) out.push_back(w);
  return out;
}

}  // namespace

std::vector<std::string> command_binaries(const std::string& command) {
  std::vector<std::string> out;
  auto words = words_of(command);
  for (size_t k = 0; k < words.size(); ++k) {
    std::string w = words[k];
    if (w.find('=') != std::string::npos) continue;  // VAR=value before the command
    if (w.find('/') == std::string::npos) {
      if (k != 0 && words[k - 1] != "exec") continue;
      auto r = run_process(spec({"sh", "-c", "command -v " + shell_quote(w)}));
      if (!r || !r->success()) continue;
      w = std::string(trim(r->out));
    }
    std::error_code ec;
    if (!w.empty() && w[0] == '/' && fs::is_regular_file(w, ec) && ::access(w.c_str(), X_OK) == 0 &&
        std::find(out.begin(), out.end(), w) == out.end())
      out.push_back(w);
  }
  return out;
}

std::optional<ImagePin> image_of_command(const std::string& command) {
  auto words = words_of(command);
  for (size_t k = 0; k + 1 < words.size(); ++k) {
    std::string rt = fs::path(words[k]).filename().string();
    if (rt != "docker" && rt != "podman") continue;
    if (words[k + 1] != "run" &&
        !(words[k + 1] == "container" && k + 2 < words.size() && words[k + 2] == "run"))
      continue;
    // The image is the first word after `run` that the runtime knows as one: no parsing of
    // every runtime option (their values look like anything).
    for (size_t i = k + 2; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w.empty() || w[0] == '-') continue;
      auto r = run_process(spec({words[k], "image", "inspect", "--format",
                                 "{{.Id}}|{{range .RepoDigests}}{{.}} {{end}}", w}));
      if (!r || !r->success()) continue;
      auto line = std::string(trim(r->out));
      auto bar = line.find('|');
      ImagePin p;
      p.runtime = rt;
      p.ref = w;
      p.id = std::string(trim(line.substr(0, bar)));
      if (bar != std::string::npos) {
        auto digests = split_list(std::string(trim(line.substr(bar + 1))), ' ');
        if (!digests.empty()) p.digest = digests[0];
      }
      if (!p.id.empty()) return p;
    }
  }
  return std::nullopt;
}

json engine_set_here(const RingConfig& cfg, int node) {
  json j{{"node", cfg.nodes.at(static_cast<size_t>(node)).name}, {"binaries", json::array()}};
  if (cfg.get("ENGINE") != "exec") return j;
  const std::string& cmd = cfg.get("ENGINE_EXEC");
  if (auto img = image_of_command(cmd))
    j["image"] = {
        {"runtime", img->runtime}, {"ref", img->ref}, {"id", img->id}, {"digest", img->digest}};
  for (const auto& b : command_binaries(cmd)) {
    auto h = hash_file(b, uint64_t{1} << 30, false);
    j["binaries"].push_back({{"path", b}, {"xxh3", h ? h->xxh3 : std::string()}});
  }
  return j;
}

EngineSet collect_engine_set(const RingConfig& cfg, const std::string& sparkctl_bin,
                             const std::string& config_text, std::chrono::milliseconds timeout) {
  EngineSet s;
  s.at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::system_clock::now().time_since_epoch())
                .count();
  s.engine = cfg.get("ENGINE");
  s.command = cfg.get("ENGINE_EXEC");
  s.config_digest = cfg.digest();
  s.config_text = config_text;
  if (s.engine != "exec") return s;
  std::vector<int> nodes;
  std::vector<std::string> cmds;
  for (const auto& n : cfg.nodes) {
    nodes.push_back(n.index);
    cmds.push_back(
        fmt::format("{} --config - node engine-set --node {}", shell_quote(sparkctl_bin), n.index));
  }
  std::vector<std::string> errs;
  for (const auto& run : run_on_nodes(cfg, jobs_on(nodes, cmds, config_text), timeout)) {
    json doc = run.ok() && run.exit_status == 0 ? json::parse(run.out, nullptr, false) : json();
    if (!doc.is_object()) {
      errs.push_back(
          fmt::format("{}: {}", run.node,
                      run.ok() ? std::string(trim(run.err)).substr(0, 300) : run.error->message));
      doc = {{"node", run.node}, {"error", errs.back()}};
    }
    s.nodes.push_back(doc);
  }
  s.error = join(errs, "; ");
  return s;
}

json to_json(const EngineSet& s) {
  return {{"at_ms", s.at_ms},
          {"engine", s.engine},
          {"command", s.command},
          {"config_digest", s.config_digest},
          {"config_text", s.config_text},
          {"nodes", s.nodes},
          {"ready", s.ready},
          {"error", s.error}};
}

EngineSet engine_set_from_json(const json& j) {
  EngineSet s;
  s.at_ms = j.value("at_ms", int64_t{0});
  s.engine = j.value("engine", "");
  s.command = j.value("command", "");
  s.config_digest = j.value("config_digest", "");
  s.config_text = j.value("config_text", "");
  s.nodes = j.value("nodes", json::array());
  s.ready = j.value("ready", false);
  s.error = j.value("error", "");
  return s;
}

Status write_engine_set(const std::string& state_dir, const char* which, const EngineSet& s) {
  std::string dir = state_dir + "/engine";
  (void)make_dirs(dir);
  std::string why;
  const std::string path = fmt::format("{}/{}.json", dir, which);
  if (!write_file_atomic(path, to_json(s).dump(2) + "\n", &why, 0600))
    return make_error(Errc::io, fmt::format("{}: {}", path, why));
  adopt_dir_owner(path);
  return Status::Ok();
}

std::optional<EngineSet> read_engine_set(const std::string& state_dir, const char* which) {
  auto text = read_file(fmt::format("{}/engine/{}.json", state_dir, which));
  if (!text) return std::nullopt;
  auto j = json::parse(*text, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  return engine_set_from_json(j);
}

Status mark_last_good(const std::string& state_dir) {
  auto cur = read_engine_set(state_dir, "current");
  if (!cur) return make_error(Errc::not_found, "no engine/current.json to mark good");
  cur->ready = true;
  SPARK_TRY(write_engine_set(state_dir, "current", *cur));
  return write_engine_set(state_dir, "last-good", *cur);
}

std::string pin_command(const std::string& command, const ImagePin& pin) {
  std::string pinned = !pin.digest.empty() ? pin.digest : pin.id;
  // Replace the ref as a whole word only.
  std::string out;
  size_t at = 0;
  while (true) {
    size_t k = command.find(pin.ref, at);
    if (k == std::string::npos) break;
    bool left = k == 0 || std::isspace(static_cast<unsigned char>(command[k - 1])) ||
                command[k - 1] == '\'' || command[k - 1] == '"';
    size_t e = k + pin.ref.size();
    bool right = e == command.size() || std::isspace(static_cast<unsigned char>(command[e])) ||
                 command[e] == '\'' || command[e] == '"';
    out += command.substr(at, k - at);
    out += left && right ? pinned : pin.ref;
    at = e;
  }
  out += command.substr(at);
  return out;
}

Result<RingConfig> rollback_config(const EngineSet& last, const EngineSet& now) {
  if (last.config_text.empty())
    return make_error(Errc::integrity, "engine/last-good.json holds no cluster file");
  Environment none;
  auto cfg = load_config_text(last.config_text, "engine/last-good.json", none, nullptr);
  if (!cfg) return cfg.error();
  std::optional<ImagePin> pin;
  for (const auto& n : last.nodes) {
    if (!n.contains("image")) continue;
    ImagePin p{n["image"].value("runtime", ""), n["image"].value("ref", ""),
               n["image"].value("id", ""), n["image"].value("digest", "")};
    if (pin && pin->id != p.id)
      return make_error(Errc::integrity,
                        fmt::format("the last good set ran image {} as {} on one node and {} on "
                                    "{}: pull the same image on every node",
                                    p.ref, pin->id, p.id, n.value("node", "")));
    pin = p;
  }
  // A binary cannot be rolled back: it must still be the one that was good.
  for (const auto& was : last.nodes)
    for (const auto& is : now.nodes) {
      if (was.value("node", "") != is.value("node", "")) continue;
      for (const auto& b : was.value("binaries", json::array()))
        for (const auto& c : is.value("binaries", json::array()))
          if (b.value("path", "") == c.value("path", "") &&
              b.value("xxh3", "") != c.value("xxh3", ""))
            return make_error(
                Errc::integrity,
                fmt::format("{}: {} changed since the last good start (xxh3 {} then, {} now): "
                            "rollback cannot bring a binary back; reinstall that build, or run "
                            "the engine from a container image, which rollback pins by digest",
                            is.value("node", ""), b.value("path", ""),
                            b.value("xxh3", "").substr(0, 16), c.value("xxh3", "").substr(0, 16)));
    }
  if (pin) {
    auto it = cfg->settings.find("ENGINE_EXEC");
    if (it != cfg->settings.end()) it->second.value = pin_command(it->second.value, *pin);
  }
  return cfg;
}

std::string describe_set(const EngineSet& s) {
  if (s.engine != "exec")
    return fmt::format("engine {} (config {})", s.engine, s.config_digest.substr(0, 12));
  std::string what;
  for (const auto& n : s.nodes) {
    if (n.contains("image")) {
      std::string id = n["image"].value("id", "");
      what = fmt::format("image {} {}", n["image"].value("ref", ""), id.substr(0, 19));
      break;
    }
  }
  if (what.empty()) {
    std::vector<std::string> b;
    if (!s.nodes.empty())
      for (const auto& x : s.nodes[0].value("binaries", json::array()))
        b.push_back(fmt::format("{} {}", fs::path(x.value("path", "")).filename().string(),
                                x.value("xxh3", "").substr(0, 12)));
    what = b.empty() ? "command " + redact(s.command) : join(b, ", ");
  }
  return fmt::format("{}; config {}{}", what, s.config_digest.substr(0, 12),
                     s.ready ? "" : " (did not reach READY)");
}

}  // namespace spark::cli
