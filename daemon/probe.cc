#include "daemon/probe.h"

#include "core/strings.h"
#include "daemon/backend.h"

namespace spark::daemon {

using Clock = std::chrono::steady_clock;

nlohmann::json to_json(const ProbeResult& p) {
  nlohmann::json j = {{"status", p.status}, {"attempts", p.attempts}, {"seconds", p.seconds}};
  if (!p.reason.empty()) j["reason"] = p.reason;
  if (!p.text.empty()) j["text"] = p.text.substr(0, 200);
  j["rdma"] = {{"checked", p.rdma_checked}, {"bytes", p.rdma_bytes * 4}};
  if (!p.rdma_note.empty()) j["rdma"]["note"] = p.rdma_note;
  return j;
}

std::optional<uint64_t> read_rdma_counters(const std::string& root,
                                           const std::vector<std::string>& hcas) {
  std::string base = (root == "/" ? std::string() : root) + "/sys/class/infiniband/";
  bool any = false;
  uint64_t sum = 0;
  for (const auto& hca : hcas) {
    for (const char* c : {"port_xmit_data", "port_rcv_data"}) {
      auto t = read_file(base + hca + "/ports/1/counters/" + c);
      if (!t) continue;
      if (auto v = parse_u64(trim(*t))) {
        sum += *v;
        any = true;
      }
    }
  }
  if (!any) return std::nullopt;
  return sum;
}

ProbeSpec probe_spec(const RingConfig& cfg) {
  ProbeSpec s;
  if (!cfg.get("PROBE_PROMPT").empty()) s.prompt = cfg.get("PROBE_PROMPT");
  s.expect = cfg.get("PROBE_EXPECT");
  if (!cfg.nodes.empty()) s.hcas = cfg.nodes[0].hcas;
  s.check_rdma = cfg.world_size() > 1 && !s.hcas.empty();
  return s;
}

ProbeResult run_probe(Backend& engine, const ProbeSpec& spec) {
  ProbeResult p;
  auto t0 = Clock::now();
  std::optional<uint64_t> before;
  if (spec.check_rdma) before = read_rdma_counters(spec.root, spec.hcas);
  auto text = engine.probe(spec.prompt, spec.timeout);
  p.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!text) {
    if (text.error().code == Errc::unsupported) {
      p.status = "skipped";
      p.reason = text.error().message;
      return p;
    }
    p.status = "failed";
    p.reason = "probe completion failed: " + text.error().message;
    return p;
  }
  p.text = *text;
  if (trim(p.text).empty()) {
    p.status = "failed";
    p.reason = "probe completion came back empty for prompt '" + spec.prompt + "'";
    return p;
  }
  if (!spec.expect.empty() && p.text.find(spec.expect) == std::string::npos) {
    p.status = "failed";
    p.reason = "probe completion '" + p.text.substr(0, 80) + "' does not contain PROBE_EXPECT '" +
               spec.expect + "'";
    return p;
  }
  if (spec.check_rdma) {
    auto after = read_rdma_counters(spec.root, spec.hcas);
    if (!before || !after) {
      p.rdma_note = "HCA counters of " + join(spec.hcas, ",") + " not readable; not checked";
    } else {
      p.rdma_checked = true;
      p.rdma_bytes = *after - *before;
      if (p.rdma_bytes == 0) {
        p.status = "failed";
        p.reason = "the probe completed but the RDMA port counters of " + join(spec.hcas, ",") +
                   " did not move: the ranks talk over sockets, not the fabric (check NCCL_IB_HCA, "
                   "/dev/infiniband in the engine, NCCL_DEBUG=INFO for 'NET/IB')";
        return p;
      }
    }
  } else if (spec.hcas.empty()) {
    p.rdma_note = "no NODE0_HCAS configured; fabric traffic not checked";
  }
  p.status = "passed";
  return p;
}

}  // namespace spark::daemon
