#include "env/facts.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/config.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/gpu.h"
#include "env/gpu_throttle.h"

namespace spark::env {

using nlohmann::json;

std::vector<std::string> NodeFacts::ipv4_of(const std::string& ifname) const {
  std::vector<std::string> out;
  for (const auto& a : addrs)
    if (a.ifname == ifname && a.family == "inet") out.push_back(a.address);
  return out;
}

std::string NodeFacts::netdev_of(const std::string& ipv4) const {
  for (const auto& a : addrs)
    if (a.family == "inet" && a.address == ipv4) return a.ifname;
  return "";
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

json limit_json(uint64_t v) {
  return v == kUnlimited ? json("unlimited") : json(v);
}
uint64_t limit_from(const json& j) {
  if (j.is_string()) return kUnlimited;
  return j.is_number_unsigned() || j.is_number_integer() ? j.get<uint64_t>() : 0;
}

template <typename T>
T get_or(const json& j, const char* key, T dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  return it->get<T>();
}

std::vector<IfAddr> live_addrs() {
  std::vector<IfAddr> out;
  struct ifaddrs* ifa = nullptr;
  if (::getifaddrs(&ifa) != 0) return out;
  for (auto* p = ifa; p; p = p->ifa_next) {
    if (!p->ifa_addr) continue;
    int fam = p->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* src =
        fam == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(p->ifa_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(p->ifa_addr)->sin6_addr);
    if (!::inet_ntop(fam, src, buf, sizeof buf)) continue;
    int prefix = 0;
    if (p->ifa_netmask) {
      const auto* m = fam == AF_INET
                          ? reinterpret_cast<const uint8_t*>(
                                &reinterpret_cast<sockaddr_in*>(p->ifa_netmask)->sin_addr)
                          : reinterpret_cast<const uint8_t*>(
                                &reinterpret_cast<sockaddr_in6*>(p->ifa_netmask)->sin6_addr);
      for (int i = 0; i < (fam == AF_INET ? 4 : 16); ++i) prefix += __builtin_popcount(m[i]);
    }
    out.push_back({p->ifa_name, fam == AF_INET ? "inet" : "inet6", buf, prefix});
  }
  ::freeifaddrs(ifa);
  return out;
}

// The listening TCP socket's inode for port (any address), from /proc/net/tcp; 0 if none.
uint64_t listen_inode(int port) {
  auto text = read_file("/proc/net/tcp");
  if (!text) return 0;
  for (const auto& line : split_list(*text, '\n')) {
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
    std::vector<std::string> f;
    for (const auto& w : split_list(line, ' '))
      if (!w.empty()) f.push_back(w);
    if (f.size() < 10 || f[3] != "0A") continue;  // 0A: LISTEN
    auto colon = f[1].find(':');
    if (colon == std::string::npos) continue;
    if (std::strtol(f[1].substr(colon + 1).c_str(), nullptr, 16) != port) continue;
    return std::strtoull(f[9].c_str(), nullptr, 10);
  }
  return 0;
}

// The pid holding socket inode `ino` (a scan of /proc/*/fd: what we may read), or 0.
int socket_holder(uint64_t ino) {
  const std::string want = "socket:[" + std::to_string(ino) + "]";
  std::error_code ec;
  for (const auto& d : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = d.path().filename();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::error_code ec2;
    for (const auto& fd : std::filesystem::directory_iterator(d.path() / "fd", ec2)) {
      std::error_code ec3;
      if (std::filesystem::read_symlink(fd.path(), ec3).string() == want) return std::stoi(name);
    }
  }
  return 0;
}

// Who listens on an address in use: pid, command line and, for a sparkd, its ring's name.
void find_holder(PortProbe& p) {
  uint64_t ino = listen_inode(p.port);
  if (ino == 0) return;
  p.holder_pid = socket_holder(ino);
  if (p.holder_pid == 0) return;
  auto raw = read_file("/proc/" + std::to_string(p.holder_pid) + "/cmdline");
  if (!raw) return;
  std::vector<std::string> argv;
  for (const auto& a : split_list(*raw, '\0'))
    if (!a.empty()) argv.push_back(a);
  p.holder_cmdline = join(argv, " ");
  if (argv.empty() || std::filesystem::path(argv[0]).filename() != "sparkd") return;
  for (size_t i = 1; i + 1 < argv.size(); ++i) {
    if (argv[i] != "--config") continue;
    // The holder's cluster file as sparkd read it (quoting and defaults included).
    std::vector<Diagnostic> diags;
    if (auto cfg = load_config(argv[i + 1], Environment{}, &diags); cfg.ok())
      p.holder_ring = cfg->get("RING_NAME");
  }
}

PortProbe try_bind(const std::string& address, int port) {
  PortProbe p;
  p.address = address;
  p.port = port;
  auto ip = parse_ipv4(address);
  if (!ip) {
    p.error = "not an IPv4 address";
    return p;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    p.error = std::strerror(errno);
    return p;
  }
  int one = 1;
  // The server sets SO_REUSEADDR too, so TIME_WAIT leftovers do not count as busy.
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(*ip);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
    p.free = true;
  } else {
    const int e = errno;
    p.error = std::strerror(e);
    if (e == EADDRINUSE) find_holder(p);
  }
  ::close(fd);
  return p;
}

}  // namespace

Residency page_cache_residency(const std::string& dir) {
  Residency r;
  std::error_code ec;
  long page = ::sysconf(_SC_PAGESIZE);
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    r.error = fmt::format("{}: {}", dir, ec.message());
    return r;
  }
  std::vector<unsigned char> vec;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (!it->is_regular_file(ec)) continue;
    int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) continue;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
      auto size = static_cast<size_t>(st.st_size);
      void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        size_t pages = (size + static_cast<size_t>(page) - 1) / static_cast<size_t>(page);
        vec.assign(pages, 0);
        if (::mincore(m, size, vec.data()) == 0) {
          uint64_t res = 0;
          for (auto b : vec) res += (b & 1);
          r.resident_bytes += std::min<uint64_t>(res * static_cast<uint64_t>(page), size);
        }
        ::munmap(m, size);
      }
      r.total_bytes += size;
      ++r.files;
    }
    ::close(fd);
  }
  return r;
}

NodeFacts collect_live_facts(const Sysroot& root, const FactsRequest& req) {
  NodeFacts f;
  struct utsname u {};
  if (::uname(&u) == 0) {
    f.hostname = u.nodename;
    f.kernel_release = u.release;
    f.machine = u.machine;
  }
  f.addrs = live_addrs();
  if (!req.model_path.empty()) {
    FsStat s;
    s.path = req.model_path;
    // The model directory may not exist yet (before staging): use the nearest parent.
    std::string p = req.model_path;
    struct statvfs v {};
    while (::statvfs(p.c_str(), &v) != 0 && p.size() > 1) {
      auto slash = p.rfind('/');
      p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
    }
    if (::statvfs(p.c_str(), &v) == 0) {
      s.total = static_cast<uint64_t>(v.f_blocks) * v.f_frsize;
      s.free = static_cast<uint64_t>(v.f_bfree) * v.f_frsize;
      s.avail = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
    } else {
      s.error = std::strerror(errno);
    }
    f.model_fs = s;
    if (std::filesystem::is_directory(req.model_path))
      f.residency = page_cache_residency(req.model_path);
  }
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    f.memlock_soft = rl.rlim_cur == RLIM_INFINITY ? kUnlimited : rl.rlim_cur;
    f.memlock_hard = rl.rlim_max == RLIM_INFINITY ? kUnlimited : rl.rlim_max;
  }
  for (const auto& [addr, port] : req.ports) f.ports.push_back(try_bind(addr, port));
  // One probe for the driver, the devices, the processes holding them and NCCL (dlopen).
  GpuProbeOptions go;
  go.root = root.root();
  go.deadline_ms = 10000;
  GpuReport g = probe_gpu(go);
  f.gpu = to_json(g);
  f.nccl = NcclLib{g.nccl_library, g.nccl_version_code, g.nccl_reason};
  f.sparkd_bin = req.sparkd_bin;
  f.sparkd_tried = req.sparkd_tried;
  if (req.gpu_load) {
    ThrottleOptions t;
    t.gpus = req.gpus;
    if (!req.sparkd_bin.empty()) t.load_argv = {req.sparkd_bin, "gpu-load"};
    f.gpu_throttle = measure_gpu_throttle(t);
  }
  if (!req.sparkd_bin.empty()) {
    ProcessSpec ps;
    ps.argv = {req.sparkd_bin, "--version"};
    ps.timeout = std::chrono::milliseconds(3000);
    auto r = run_process(ps);
    if (r && r->success()) {
      f.sparkd_version = std::string(trim(r->out.substr(0, r->out.find('\n'))));
    } else if (!r) {
      f.sparkd_error = r.error().message;
    } else {
      // A missing shared library or a wrong architecture shows in its stderr.
      std::string why(trim(r->err.empty() ? r->out : r->err));
      if (why.size() > 300) why = why.substr(0, 300) + "...";
      f.sparkd_error = r->describe() + (why.empty() ? "" : ": " + why);
    }
  }
  f.uid = static_cast<int>(::getuid());
  if (auto* pw = ::getpwuid(::getuid())) f.user = pw->pw_name;
  for (const auto& name : root.list("/dev/infiniband"))
    if (starts_with(name, "uverbs"))
      f.uverbs.emplace_back(
          name, ::access(root.path("/dev/infiniband/" + name).c_str(), R_OK | W_OK) == 0);
  f.clock_ms = now_ms();
  return f;
}

json facts_to_json(const NodeFacts& f) {
  json j;
  j["schema"] = f.schema;
  j["hostname"] = f.hostname;
  j["kernel_release"] = f.kernel_release;
  j["machine"] = f.machine;
  j["addrs"] = json::array();
  for (const auto& a : f.addrs)
    j["addrs"].push_back(
        {{"ifname", a.ifname}, {"family", a.family}, {"address", a.address}, {"prefix", a.prefix}});
  if (f.model_fs)
    j["model_fs"] = {{"path", f.model_fs->path},
                     {"total", f.model_fs->total},
                     {"free", f.model_fs->free},
                     {"avail", f.model_fs->avail},
                     {"error", f.model_fs->error}};
  j["memlock"] = {{"soft", limit_json(f.memlock_soft)}, {"hard", limit_json(f.memlock_hard)}};
  j["clock_ms"] = f.clock_ms;
  j["ports"] = json::array();
  for (const auto& p : f.ports)
    j["ports"].push_back({{"address", p.address},
                          {"port", p.port},
                          {"free", p.free},
                          {"error", p.error},
                          {"holder_pid", p.holder_pid},
                          {"holder_cmdline", p.holder_cmdline},
                          {"holder_ring", p.holder_ring}});
  if (f.residency)
    j["page_cache"] = {{"total_bytes", f.residency->total_bytes},
                       {"resident_bytes", f.residency->resident_bytes},
                       {"files", f.residency->files},
                       {"error", f.residency->error}};
  j["nccl"] = {{"path", f.nccl.path}, {"version", f.nccl.version}, {"error", f.nccl.error}};
  j["sparkd_version"] = f.sparkd_version;
  j["sparkd_bin"] = f.sparkd_bin;
  j["sparkd_error"] = f.sparkd_error;
  j["sparkd_tried"] = f.sparkd_tried;
  j["user"] = f.user;
  j["uid"] = f.uid;
  j["uverbs"] = json::array();
  for (const auto& [n, ok] : f.uverbs) j["uverbs"].push_back({{"name", n}, {"rw", ok}});
  j["gpu"] = f.gpu;
  if (!f.gpu_throttle.is_null()) j["gpu_throttle"] = f.gpu_throttle;
  return j;
}

Result<NodeFacts> facts_from_json(const json& j) {
  try {
    NodeFacts f;
    f.schema = get_or<int>(j, "schema", 0);
    if (f.schema != kFactsSchema)
      return make_error(Errc::unsupported, fmt::format("facts.json schema {} (this sparkctl reads "
                                                       "schema {})",
                                                       f.schema, kFactsSchema));
    f.hostname = get_or<std::string>(j, "hostname", "");
    f.kernel_release = get_or<std::string>(j, "kernel_release", "");
    f.machine = get_or<std::string>(j, "machine", "");
    for (const auto& a : j.value("addrs", json::array()))
      f.addrs.push_back({a.at("ifname").get<std::string>(), a.at("family").get<std::string>(),
                         a.at("address").get<std::string>(), get_or<int>(a, "prefix", 0)});
    if (j.contains("model_fs") && j["model_fs"].is_object()) {
      const auto& m = j["model_fs"];
      f.model_fs = FsStat{get_or<std::string>(m, "path", ""), get_or<uint64_t>(m, "total", 0),
                          get_or<uint64_t>(m, "free", 0), get_or<uint64_t>(m, "avail", 0),
                          get_or<std::string>(m, "error", "")};
    }
    if (j.contains("memlock")) {
      f.memlock_soft = limit_from(j["memlock"].value("soft", json(0)));
      f.memlock_hard = limit_from(j["memlock"].value("hard", json(0)));
    }
    f.clock_ms = get_or<int64_t>(j, "clock_ms", 0);
    for (const auto& p : j.value("ports", json::array()))
      f.ports.push_back({get_or<std::string>(p, "address", ""), get_or<int>(p, "port", 0),
                         get_or<bool>(p, "free", false), get_or<std::string>(p, "error", ""),
                         get_or<int>(p, "holder_pid", 0),
                         get_or<std::string>(p, "holder_cmdline", ""),
                         get_or<std::string>(p, "holder_ring", "")});
    if (j.contains("page_cache") && j["page_cache"].is_object()) {
      const auto& r = j["page_cache"];
      f.residency =
          Residency{get_or<uint64_t>(r, "total_bytes", 0), get_or<uint64_t>(r, "resident_bytes", 0),
                    get_or<int>(r, "files", 0), get_or<std::string>(r, "error", "")};
    }
    if (j.contains("nccl"))
      f.nccl =
          NcclLib{get_or<std::string>(j["nccl"], "path", ""), get_or<int>(j["nccl"], "version", 0),
                  get_or<std::string>(j["nccl"], "error", "")};
    f.sparkd_version = get_or<std::string>(j, "sparkd_version", "");
    f.sparkd_bin = get_or<std::string>(j, "sparkd_bin", "");
    f.sparkd_error = get_or<std::string>(j, "sparkd_error", "");
    f.sparkd_tried = get_or<std::string>(j, "sparkd_tried", "");
    f.user = get_or<std::string>(j, "user", "");
    f.uid = get_or<int>(j, "uid", -1);
    for (const auto& u : j.value("uverbs", json::array()))
      f.uverbs.emplace_back(u.at("name").get<std::string>(), get_or<bool>(u, "rw", false));
    f.gpu = j.value("gpu", json());
    f.gpu_throttle = j.value("gpu_throttle", json());
    return f;
  } catch (const json::exception& e) {
    return make_error(Errc::io, fmt::format("facts.json: {}", e.what()));
  }
}

Result<NodeFacts> node_facts(const Sysroot& root, const FactsRequest& req) {
  if (root.live()) return collect_live_facts(root, req);
  auto text = root.read("/facts.json", kJsonReadCap);
  if (!text && root.problem("/facts.json"))
    return make_error(
        Errc::io, fmt::format("{}: {}", root.path("/facts.json"), *root.problem("/facts.json")));
  if (!text)
    return make_error(Errc::not_found,
                      fmt::format("{}: no facts.json in the captured tree (make captures with "
                                  "`sparkctl capture-node`)",
                                  root.path("/facts.json")));
  json j = json::parse(*text, nullptr, false);
  if (j.is_discarded())
    return make_error(Errc::io, fmt::format("{}: not valid JSON", root.path("/facts.json")));
  auto f = facts_from_json(j);
  if (!f) return make_error(f.error().code, root.path("/facts.json") + ": " + f.error().message);
  return f;
}

}  // namespace spark::env
