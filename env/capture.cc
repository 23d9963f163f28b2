#include "env/capture.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>

#include "core/install_layout.h"
#include "core/strings.h"
#include "env/facts.h"
#include "env/net.h"
#include "env/preflight.h"
#include "env/rdma.h"

namespace spark::env {

namespace fs = std::filesystem;

Result<CaptureSummary> capture_node_tree(const RingConfig* cfg, int node_index,
                                         const std::string& live_root, const std::string& out_dir,
                                         bool gpu_load) {
  Sysroot root(live_root);
  root.record(true);
  FactsRequest req;
  if (cfg) {
    const auto& n = cfg->nodes.at(static_cast<size_t>(node_index));
    req.gpus = n.gpus;
    req.gpu_load = gpu_load;
    req.sparkd_bin = cfg->get("SPARKD_BIN");
    if (req.sparkd_bin.empty() && root.live()) {
      std::error_code ec;
      auto self = fs::canonical("/proc/self/exe", ec);
      if (!ec) req.sparkd_bin = locate_sparkd(self.string());
    }
    CheckFilter all;
    if (!gpu_load) all.skip = {"gpu.throttle"};
    (void)run_node_checks(*cfg, node_index, root, all, false);
    req.model_path = n.model_path;
    if (n.index == 0) {
      req.ports.emplace_back(cfg->get("API_BIND"), static_cast<int>(cfg->get_int("API_PORT")));
      req.ports.emplace_back(n.fabric_ip, static_cast<int>(cfg->get_int("RDZV_PORT")));
    }
  }
  // Everything RDMA and network the node has, so a wrong cluster file still gives a useful
  // capture.
  for (const auto& h : list_hcas(root)) (void)read_hca(root, h);
  for (const auto& d : root.list("/sys/class/net")) (void)read_netdev(root, d);
  for (const char* f :
       {"/proc/meminfo", "/proc/cmdline", "/sys/kernel/mm/transparent_hugepage/enabled",
        "/sys/class/dmi/id/product_name", "/sys/module/nvidia/version"})
    (void)root.read(f);
  (void)root.list("/dev/infiniband");
  root.record(false);

  NodeFacts facts;
  if (root.live()) {
    facts = collect_live_facts(root, req);
  } else {
    auto f = node_facts(root, req);
    if (!f) return f.error();
    facts = *f;
  }

  CaptureSummary sum;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return make_error(Errc::io, fmt::format("{}: {}", out_dir, ec.message()));
  auto dest = [&](const std::string& abs) { return out_dir + abs; };
  // A listing is a read too: every name in a listed directory exists in the capture (as an
  // empty directory or file unless its content was read as well).
  for (const auto& d : root.recorded_dirs()) {
    if (!root.exists(d)) continue;
    fs::create_directories(dest(d), ec);
    ++sum.dirs;
    for (const auto& name : root.list(d)) {
      std::string child = d + "/" + name;
      if (fs::is_directory(root.path(child), ec))
        fs::create_directories(dest(child), ec);
      else if (!fs::exists(dest(child)))
        write_file_atomic(dest(child), "", nullptr);
    }
  }
  for (const auto& f : root.recorded_files()) {
    // As bounded as the probes' own reads: a FIFO or an endless file is not copied.
    auto text = read_file_bounded(root.path(f), kJsonReadCap);
    if (!text) continue;  // unreadable (EINVAL on a down link's speed): replays as unreadable
    fs::create_directories(fs::path(dest(f)).parent_path(), ec);
    std::string why;
    if (!write_file_atomic(dest(f), *text, &why))
      return make_error(Errc::io, fmt::format("capture {}: {}", f, why));
    ++sum.files;
  }
  // Device nodes under /dev/infiniband replay as empty files (existence is what is read).
  for (const auto& u : root.list("/dev/infiniband")) {
    fs::create_directories(dest("/dev/infiniband"), ec);
    if (!fs::exists(dest("/dev/infiniband/" + u)))
      write_file_atomic(dest("/dev/infiniband/" + u), "", nullptr);
  }
  for (const auto& f : root.recorded_sized()) {
    auto size = root.file_size(f);
    if (!size || root.recorded_files().count(f)) continue;  // content captured above
    fs::create_directories(fs::path(dest(f)).parent_path(), ec);
    int fd = ::open(dest(f).c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(*size)) != 0) {
      if (fd >= 0) ::close(fd);
      return make_error(Errc::io, fmt::format("capture {}: cannot create a sparse stand-in", f));
    }
    ::close(fd);
    ++sum.sized;
  }
  std::string why;
  if (!write_file_atomic(
          out_dir + "/facts.json",
          facts_to_json(facts).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n",
          &why))
    return make_error(Errc::io, "facts.json: " + why);
  return sum;
}

}  // namespace spark::env
