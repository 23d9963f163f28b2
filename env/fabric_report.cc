#include "env/fabric_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <regex>
#include <sstream>

#include "core/strings.h"

namespace spark::env {

namespace {

std::string size_text(size_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return fmt::format("{} MB", b >> 20);
  if (b >= (1u << 10) && b % (1u << 10) == 0) return fmt::format("{} KB", b >> 10);
  return fmt::format("{} B", b);
}

// The message part of one debug line: what follows "NCCL INFO " / "NCCL WARN ".
bool message_of(const std::string& line, const char* tag, std::string* msg) {
  auto p = line.find(tag);
  if (p == std::string::npos) return false;
  *msg = line.substr(p + std::char_traits<char>::length(tag));
  while (!msg->empty() && (msg->back() == '\r' || msg->back() == ' ')) msg->pop_back();
  return true;
}

std::string transport_class(const std::string& via) {
  if (via.rfind("NET/IB", 0) == 0) return "NET/IB";
  if (via.rfind("NET/Socket", 0) == 0) return "NET/Socket";
  if (via.rfind("NET/", 0) == 0) return via.substr(0, via.find('/', 4));
  if (via.rfind("P2P", 0) == 0) return "P2P";
  if (via.rfind("SHM", 0) == 0 || via.find("shared memory") != std::string::npos) return "SHM";
  if (via.rfind("CollNet", 0) == 0) return "CollNet";
  return via.substr(0, via.find('/'));
}

std::string strip_port(const std::string& dev) {
  return dev.substr(0, dev.find(':'));
}

}  // namespace

NcclTransportFacts parse_nccl_debug(const std::string& text, int rank) {
  NcclTransportFacts f;
  static const std::regex kChannel(
      R"((?:Channel|Ring) \d+(?:/\d+)? : (\d+)\[[^\]]*\] -> (\d+)\[[^\]]*\](?: \[(?:send|receive)\])? via (.+)$)");
  static const std::regex kDev(R"(\[(\d+)\]([^ \[\];]+))");
  std::istringstream in(text);
  std::string line, msg;
  while (std::getline(in, line)) {
    if (message_of(line, "NCCL WARN ", &msg)) {
      f.warnings.push_back(msg);
      continue;
    }
    if (!message_of(line, "NCCL INFO ", &msg)) {
      if (message_of(line, "NCCL version ", &msg)) f.version = msg.substr(0, msg.find(' '));
      continue;
    }
    if (msg.rfind("NCCL version ", 0) == 0) {
      f.version = msg.substr(
          13, msg.find(' ', 13) == std::string::npos ? std::string::npos : msg.find(' ', 13) - 13);
    } else if ((msg.rfind("NET/IB", 0) == 0 && msg.find("No device found") != std::string::npos) ||
               msg.rfind("Failed to initialize NET plugin IB", 0) == 0) {
      // Up to 2.2x "NET/IB : No device found."; 2.28 says the plugin failed to initialise.
      f.ib_no_device = true;
    } else if (msg.rfind("NET/IB", 0) == 0 && msg.find("Using ") != std::string::npos) {
      f.ib_devices.clear();
      std::string list = msg.substr(msg.find("Using ") + 6);
      list = list.substr(0, list.find("; OOB"));
      for (auto it = std::sregex_iterator(list.begin(), list.end(), kDev);
           it != std::sregex_iterator(); ++it) {
        std::string dev = (*it)[2];  // "rocep1s0f0:1/RoCE"
        auto slash = dev.find('/');
        if (slash != std::string::npos) f.ib_link = dev.substr(slash + 1), dev.resize(slash);
        f.ib_devices.push_back(dev);
      }
    } else if (msg.rfind("NET/Socket", 0) == 0 && msg.find("Using ") != std::string::npos) {
      f.socket_ifs.clear();
      std::string list = msg.substr(msg.find("Using ") + 6);
      for (auto it = std::sregex_iterator(list.begin(), list.end(), kDev);
           it != std::sregex_iterator(); ++it) {
        std::string s = (*it)[2];
        f.socket_ifs.push_back(s.substr(0, s.find('<')));
      }
    } else if (msg.rfind("Using network ", 0) == 0) {
      f.network = msg.substr(14);
    } else if (msg.rfind("NCCL_IB_GID_INDEX set by environment to ", 0) == 0) {
      f.gid_index = std::atoi(msg.c_str() + 40);
    } else {
      std::smatch m;
      if (!std::regex_search(msg, m, kChannel)) continue;
      int a = std::stoi(m[1]), b = std::stoi(m[2]);
      int peer = a == rank ? b : b == rank ? a : -1;
      if (peer < 0 || peer == rank) continue;
      NcclTransportFacts::Peer p;
      p.peer = peer;
      p.detail = m[3];
      p.transport = transport_class(p.detail);
      if (p.transport == "NET/IB" && p.detail.size() > 7) {
        size_t idx = std::strtoul(p.detail.c_str() + 7, nullptr, 10);
        if (idx < f.ib_devices.size()) p.hca = strip_port(f.ib_devices[idx]);
      }
      bool seen = std::any_of(f.peers.begin(), f.peers.end(), [&](const auto& q) {
        return q.peer == p.peer && q.detail == p.detail;
      });
      if (!seen) f.peers.push_back(std::move(p));
    }
  }
  std::sort(f.peers.begin(), f.peers.end(), [](const auto& x, const auto& y) {
    return x.peer != y.peer ? x.peer < y.peer : x.detail < y.detail;
  });
  return f;
}

FabricExpect fabric_expect_from_env(int rank, int world, const std::string& node,
                                    double min_busbw) {
  FabricExpect e;
  e.rank = rank;
  e.world = world;
  e.node = node;
  e.min_busbw = min_busbw;
  auto env = [](const char* k) -> std::string {
    const char* v = std::getenv(k);
    return v ? v : "";
  };
  std::string hca = env("NCCL_IB_HCA");
  if (!hca.empty() && (hca[0] == '=' || hca[0] == '^')) {
    if (hca[0] == '^')
      hca.clear();  // an exclusion list names no expected device
    else
      hca.erase(0, 1);
  }
  for (const auto& h : split_list(hca, ','))
    if (!h.empty()) e.hcas.push_back(strip_port(h));
  e.rdma = !e.hcas.empty() && env("NCCL_IB_DISABLE") != "1";
  if (auto g = parse_i64(env("NCCL_IB_GID_INDEX")); g) e.gid_index = static_cast<int>(*g);
  return e;
}

std::vector<size_t> fabric_sizes(size_t min_bytes, size_t max_bytes) {
  std::vector<size_t> v;
  for (size_t b = std::max<size_t>(min_bytes, 4); b <= max_bytes; b *= 2) v.push_back(b);
  return v;
}

double fabric_bus_factor(const std::string& op, int world) {
  if (world < 1) return 0;
  double n = world;
  return op == "all_reduce" ? 2.0 * (n - 1) / n : (n - 1) / n;
}

int fabric_iters(size_t bytes) {
  size_t it = (size_t{256} << 20) / std::max<size_t>(bytes, 1);
  return static_cast<int>(std::clamp<size_t>(it, 5, 50));
}

void fabric_bandwidth(FabricPoint& p, int world) {
  p.algbw = p.time_us > 0 ? static_cast<double>(p.bytes) / (p.time_us * 1e3) : 0;
  p.busbw = p.algbw * fabric_bus_factor(p.op, world);
}

std::string FabricReport::summary() const {
  std::string s = passed() ? "passed" : "FAILED";
  double ar = 0, ag = 0;
  size_t at = 0;
  for (const auto& p : points) {
    if (p.bytes < at) continue;
    at = p.bytes;
    (p.op == "all_reduce" ? ar : ag) = p.busbw;
  }
  if (!points.empty())
    s += fmt::format(
        ": busbw all-reduce {:.1f} GB/s, all-gather {:.1f} GB/s at {}; 8 KB "
        "all-reduce {:.1f} us",
        ar, ag, size_text(at), decode_latency_us_8k);
  std::vector<std::string> via;
  for (const auto& p : nccl.peers) {
    std::string t = fmt::format("{} via {}", p.peer, p.transport);
    if (std::find(via.begin(), via.end(), t) == via.end()) via.push_back(t);
  }
  if (!via.empty()) s += "; peers " + join(via, ", ");
  if (!failures.empty()) s += " — " + failures.front();
  return s;
}

void judge_fabric(FabricReport& r, const FabricExpect& e) {
  const std::string who =
      e.node.empty() ? fmt::format("rank {}", r.rank) : fmt::format("rank {} ({})", r.rank, e.node);
  for (const auto& p : r.points)
    if (p.wrong)
      r.failures.push_back(
          fmt::format("{}: {} of {}: {} of {} values wrong — the fabric or the "
                      "GPU corrupts data; run `sparkctl preflight --fabric`",
                      who, p.op, size_text(p.bytes), p.wrong, p.count));
  const auto& f = r.nccl;
  if (e.rdma) {
    const std::string pinned = join(e.hcas, ",");
    if (f.ib_no_device)
      r.failures.push_back(fmt::format(
          "{}: NCCL found no RDMA device (NET/IB : No device found) although NCCL_IB_HCA={} is "
          "configured — the process cannot open /dev/infiniband/uverbs* (container or "
          "permissions) or the HCA is down; `sparkctl preflight --only rdma`",
          who, pinned));
    bool socket = f.network == "Socket";
    for (const auto& p : f.peers)
      if (p.transport == "NET/Socket") socket = true;
    if (socket && !f.ib_no_device)
      r.failures.push_back(
          fmt::format("{}: NCCL fell back to sockets (NET/Socket) although RDMA is configured "
                      "(NCCL_IB_HCA={}); check that NCCL_IB_DISABLE is 0 and the HCAs are ACTIVE",
                      who, pinned));
    if (!f.ib_devices.empty()) {
      std::vector<std::string> used, missing;
      for (const auto& d : f.ib_devices) used.push_back(strip_port(d));
      for (const auto& h : e.hcas)
        if (std::find(used.begin(), used.end(), h) == used.end()) missing.push_back(h);
      if (!missing.empty())
        r.failures.push_back(fmt::format(
            "{}: NCCL uses {} but not {} of NCCL_IB_HCA={} (both twins of a cable carry half of "
            "its bandwidth); check the port state with `sparkctl preflight --only rdma`",
            who, join(used, ","), join(missing, ","), pinned));
    }
    if (e.gid_index && f.gid_index && *e.gid_index != *f.gid_index)
      r.failures.push_back(fmt::format(
          "{}: NCCL used RoCE GID index {} but preflight resolved {} for {} — the process "
          "environment overrides the ring's pins; start the ring with `sparkctl start`",
          who, *f.gid_index, *e.gid_index, pinned));
    if (r.world > 1 && f.version.empty() && f.peers.empty() && f.ib_devices.empty() &&
        !f.ib_no_device)
      r.failures.push_back(fmt::format(
          "{}: NCCL wrote no INIT/NET debug output, so the transport cannot be checked (is "
          "NCCL_DEBUG or NCCL_DEBUG_FILE set by hand?)",
          who));
  }
  for (const auto& w : f.warnings)
    if (w.find("ibv_") != std::string::npos || w.find("GID") != std::string::npos ||
        w.find("NET/IB") != std::string::npos)
      r.failures.push_back(fmt::format("{}: NCCL warned: {}{}", who, w,
                                       e.gid_index ? fmt::format(" (NCCL_IB_GID_INDEX={}: check "
                                                                 "it is this node's RoCE v2 "
                                                                 "IPv4 GID)",
                                                                 *e.gid_index)
                                                   : std::string()));
  if (e.min_busbw > 0 && r.world > 1) {
    for (const char* op : {"all_reduce", "all_gather"}) {
      const FabricPoint* top = nullptr;
      for (const auto& p : r.points)
        if (p.op == op && (!top || p.bytes > top->bytes)) top = &p;
      if (top && top->busbw < e.min_busbw)
        r.failures.push_back(fmt::format(
            "{}: {} bus bandwidth {:.2f} GB/s at {} is under FABRIC_MIN_BUSBW={:g} GB/s — check "
            "link speed and MTU (`sparkctl preflight --only links`) and that both twins are in "
            "NCCL_IB_HCA",
            who, op, top->busbw, size_text(top->bytes), e.min_busbw));
    }
  }
}

nlohmann::json to_json(const FabricReport& r) {
  nlohmann::json pts = nlohmann::json::array();
  for (const auto& p : r.points)
    pts.push_back({{"op", p.op},
                   {"bytes", p.bytes},
                   {"count", p.count},
                   {"iters", p.iters},
                   {"time_us", p.time_us},
                   {"algbw_gbs", p.algbw},
                   {"busbw_gbs", p.busbw},
                   {"wrong", p.wrong}});
  nlohmann::json peers = nlohmann::json::array();
  for (const auto& p : r.nccl.peers)
    peers.push_back(
        {{"peer", p.peer}, {"transport", p.transport}, {"detail", p.detail}, {"hca", p.hca}});
  nlohmann::json j = {
      {"rank", r.rank},
      {"world_size", r.world},
      {"node", r.node},
      {"passed", r.passed()},
      {"failures", r.failures},
      {"seconds", r.seconds},
      {"decode_latency_us", {{"8192", r.decode_latency_us_8k}, {"16384", r.decode_latency_us_16k}}},
      {"points", pts},
      {"nccl",
       {{"version", r.nccl.version},
        {"network", r.nccl.network},
        {"ib_devices", r.nccl.ib_devices},
        {"ib_link", r.nccl.ib_link},
        {"socket_ifs", r.nccl.socket_ifs},
        {"gid_index", r.nccl.gid_index ? nlohmann::json(*r.nccl.gid_index) : nlohmann::json()},
        {"peers", peers},
        {"warnings", r.nccl.warnings}}}};
  return j;
}

Result<FabricReport> fabric_report_from_json(const nlohmann::json& j) {
  try {
    FabricReport r;
    r.rank = j.at("rank").get<int>();
    r.world = j.at("world_size").get<int>();
    r.node = j.value("node", "");
    r.failures = j.at("failures").get<std::vector<std::string>>();
    r.seconds = j.value("seconds", 0.0);
    r.decode_latency_us_8k = j.at("decode_latency_us").value("8192", 0.0);
    r.decode_latency_us_16k = j.at("decode_latency_us").value("16384", 0.0);
    for (const auto& p : j.at("points")) {
      FabricPoint q;
      q.op = p.at("op");
      q.bytes = p.at("bytes");
      q.count = p.at("count");
      q.iters = p.value("iters", 0);
      q.time_us = p.at("time_us");
      q.algbw = p.at("algbw_gbs");
      q.busbw = p.at("busbw_gbs");
      q.wrong = p.at("wrong");
      r.points.push_back(q);
    }
    const auto& n = j.at("nccl");
    r.nccl.version = n.value("version", "");
    r.nccl.network = n.value("network", "");
    r.nccl.ib_devices = n.value("ib_devices", std::vector<std::string>{});
    r.nccl.ib_link = n.value("ib_link", "");
    r.nccl.socket_ifs = n.value("socket_ifs", std::vector<std::string>{});
    if (n.contains("gid_index") && n["gid_index"].is_number_integer())
      r.nccl.gid_index = n["gid_index"].get<int>();
    for (const auto& p : n.value("peers", nlohmann::json::array()))
      r.nccl.peers.push_back({p.at("peer").get<int>(), p.value("transport", ""),
                              p.value("detail", ""), p.value("hca", "")});
    r.nccl.warnings = n.value("warnings", std::vector<std::string>{});
    return r;
  } catch (const std::exception& e) {
    return make_error(Errc::integrity, std::string("fabric report: ") + e.what());
  }
}

std::string render_fabric_table(const std::vector<FabricReport>& reports) {
  std::string out;
  for (const auto& r : reports) {
    out += fmt::format("# rank {} of {}{}: {}\n", r.rank, r.world,
                       r.node.empty() ? "" : " (" + r.node + ")", r.summary());
    if (!r.nccl.version.empty() || !r.nccl.ib_devices.empty())
      out +=
          fmt::format("#   NCCL {} network {} IB {} {} GID index {}\n",
                      r.nccl.version.empty() ? "?" : r.nccl.version,
                      r.nccl.network.empty() ? "?" : r.nccl.network,
                      r.nccl.ib_devices.empty() ? "-" : join(r.nccl.ib_devices, ","),
                      r.nccl.ib_link, r.nccl.gid_index ? std::to_string(*r.nccl.gid_index) : "-");
    for (const auto& p : r.nccl.peers)
      out += fmt::format("#   peer {} via {}{}\n", p.peer, p.detail,
                         p.hca.empty() ? "" : " (" + p.hca + ")");
    out += fmt::format("# {:>12} {:>12} {:>11} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "size(B)",
                       "count", "op", "iters", "time(us)", "algbw", "busbw", "#wrong");
    for (const auto& p : r.points)
      out += fmt::format("  {:>12} {:>12} {:>11} {:>6} {:>10.2f} {:>8.2f} {:>8.2f} {:>7}\n",
                         p.bytes, p.count, p.op, p.iters, p.time_us, p.algbw, p.busbw, p.wrong);
    for (const auto& f : r.failures) out += "# FAIL " + f + "\n";
  }
  return out;
}

}  // namespace spark::env
