#include "support/ring.h"

#include <fmt/format.h>

#include "core/strings.h"

namespace spark::test {

std::string ring_unavailable_reason() {
  if (auto why = netns_unavailable_reason(); !why.empty()) return why;
  if (auto why = sshd_unavailable_reason(); !why.empty()) return why;
  return "";
}

Result<std::unique_ptr<TestRing>> TestRing::create(const TestRingOptions& opts) {
  std::unique_ptr<TestRing> r(new TestRing());
  r->sparkctl_bin_ = opts.sparkctl_bin;
  auto net = NetNs::create({.hosts = opts.nodes, .links = opts.links, .mtu = opts.mtu});
  if (!net) return net.error();
  r->net_ = std::move(*net);
  std::string known;
  for (int i = 1; i < opts.nodes; ++i) {
    SshdOptions so{.host = r->net_->ip(i), .netns = r->net_->ns(i)};
    if (i > 1) so.identity = r->sshd_[0]->identity();
    auto s = Sshd::start(so);
    if (!s) return make_error(s.error().code, fmt::format("node {}: {}", i, s.error().message));
    known += (*s)->known_hosts_line() + "\n";
    r->sshd_.push_back(std::move(*s));
  }
  r->known_hosts_ = r->dir_.write("known_hosts", known);

  // A small model the native engine accepts on 1-4 ranks (preflight's model.engine): GQA,
  // 4 layers, two shards, a tokenizer, and its manifest.
  std::string model = r->dir_ / "model";
  r->dir_.write(
      "model/config.json",
      R"({"architectures":["LlamaForCausalLM"],"num_hidden_layers":4,"num_attention_heads":12,)"
      R"("num_key_value_heads":12,"head_dim":64,"hidden_size":768,"intermediate_size":1536,)"
      R"("vocab_size":1536,"torch_dtype":"bfloat16"})");
  r->dir_.write("model/tokenizer.json",
                R"({"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}})");
  r->dir_.write(
      "model/model.safetensors.index.json",
      R"({"metadata":{"total_size":4096},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
      R"("b":"model-00002-of-00002.safetensors"}})");
  r->dir_.write("model/model-00001-of-00002.safetensors", std::string(2048, 'a'));
  r->dir_.write("model/model-00002-of-00002.safetensors", std::string(2048, 'b'));
  // The manifest as staging writes it.
  ProcessSpec man;
  man.argv = {opts.sparkctl_bin, "manifest", model};
  man.timeout = std::chrono::seconds(30);
  auto made = run_process(man);
  if (!made || !made->success())
    return make_error(Errc::internal, fmt::format("sparkctl manifest {}: {}", model,
                                                  made ? made->describe() + " " + made->err
                                                       : made.error().message));

  std::string netdevs;
  for (int l = 0; l < opts.links; ++l) netdevs += (l ? "," : "") + r->net_->ifname(l);
  std::string cfg = fmt::format(
      "RING_NAME=test\nMODEL_PATH={}\nCONTEXT_LEN=1024\nSLOTS=2\nMEM_FREE_MIN=64MiB\n"
      "MEM_AVAILABLE_MIN=128MiB\nMEM_RESERVE=64MiB\nSSH_IDENTITY={}\nSSH_KNOWN_HOSTS={}\n"
      "SSH_TIMEOUT=5s\nSPARKCTL_BIN={}\nMTU_MIN={}\n",
      model, r->sshd_.empty() ? "" : r->sshd_[0]->identity(), r->known_hosts_, opts.sparkctl_bin,
      opts.mtu);
  for (int i = 0; i < opts.nodes; ++i) {
    cfg += fmt::format("NODE{}_NAME=ns{}\n", i, i);
    cfg += i == 0 ? "NODE0_SSH=local\n"
                  : fmt::format("NODE{}_SSH={}@{}:22\n", i,
                                r->sshd_[static_cast<size_t>(i - 1)]->user(), r->net_->ip(i));
    cfg += fmt::format("NODE{}_FABRIC_IP={}\nNODE{}_NETDEVS={}\n", i, r->net_->ip(i), i, netdevs);
  }
  for (const auto& l : opts.extra_config) cfg += l + "\n";
  r->config_ = r->dir_.write("ring.env", cfg);
  return r;
}

Result<ProcessResult> TestRing::sparkctl(const std::string& args,
                                         std::chrono::milliseconds timeout) const {
  return net_->exec_in(0, fmt::format("{} --config {} {}", sparkctl_bin_, config_, args), timeout);
}

}  // namespace spark::test
