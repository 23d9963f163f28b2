// spark-engine: the engine without the HTTP server, for tests, benchmarks and bring-up.
//   spark-engine generate --model DIR --prompt 1,2,3 [--max-tokens N] [--temperature T]
//                [--seed S] [--n N] [--tp-size W --tp-rank R --store HOST:PORT --bind IP]
//                [--device cpu|cuda|auto] [--device-ordinal N] [--collective gloo|nccl]
//                [--graphs 0|1] [--logprobs 1] [--top-p P] [--overlap 0|1]
//                [--expert-parallel auto|tp|ep] (an MoE model's experts: EXPERT_PARALLEL)
//     (--overlap 0: rank 0 posts each step plan after the step before ends, lock-step)
//     (on CUDA with --collective gloo the ranks may share one GPU: the activations are
//     staged through host memory and decode steps run eagerly; nccl needs one GPU per rank
//     and keeps decode steps in CUDA graphs)
//   spark-engine bench --model DIR|--demo [--concurrency 1,4] [--prompt-tokens 32] [--max-tokens
//   64]
//                [--slots 4] [--threads 1] [--json]
//   spark-engine tpbench [--tp-size 2] [--hidden 512] [--layers 8] [--vocab 8192] [--batch 1]
//                [--tokens 64] [--rounds 3] [--threads 1] [--json]
//                (the TP control plane's cost per decode step; bench/engine/tp_bench.h)
//   spark-engine gpubench --model DIR [--json-out FILE] [--context 33792] [--max-tokens 256]
//                [--weights auto|device|host-mapped] [--b1-runs 3] [--decode-only 1]
//                [--streams 8,32] (the aggregate rows; with --decode-only 1 none unless given)
//                [--synthetic 1] (DIR holds config.json only: random weights on the GPU)
//                [--slots 32] [--prompt-tokens 128] [--kv-dtype auto|bf16|fp8|fp32]
//                (a CUDA GPU; bench/engine/gpu_bench.h)
// generate prints one JSON object on rank 0; other ranks serve rank 0's steps and print
// {"rank": R, "worker": "stopped", "plans": ...} (its control plane's counts) when rank 0 is
// done. Exit codes as sparkctl(1).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/engine/engine_bench.h"
#include "bench/engine/gpu_bench.h"
#include "bench/engine/tp_bench.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "daemon/engine/demo_model.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/nccl_collective.h"
#include "daemon/engine/tcp_store.h"

using namespace spark;
using namespace spark::engine;

namespace {

int fail(const Error& e) {
  std::fprintf(stderr, "spark-engine: %s\n", e.message.c_str());
  return exit_code(e.code);
}

struct Args {
  std::string cmd;
  std::map<std::string, std::string> opt;
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = opt.find(k);
    return it == opt.end() ? def : it->second;
  }
  bool has(const std::string& k) const { return opt.count(k) > 0; }
};

Result<Args> parse(int argc, char** argv) {
  Args a;
  if (argc < 2)
    return make_error(Errc::usage, "usage: spark-engine generate|bench --model DIR [options]");
  a.cmd = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    if (!starts_with(k, "--")) return make_error(Errc::usage, "unexpected argument " + k);
    k = k.substr(2);
    if (k == "json" || k == "demo") {
      a.opt[k] = "1";
      continue;
    }
    if (i + 1 >= argc) return make_error(Errc::usage, "--" + k + " needs a value");
    a.opt[k] = argv[++i];
  }
  if (!a.has("model") && !(a.cmd == "bench" && a.has("demo")) && a.cmd != "tpbench")
    return make_error(Errc::usage, "--model DIR is required (bench also takes --demo)");
  return a;
}

Result<int> int_opt(const Args& a, const std::string& k, int def) {
  if (!a.has(k)) return def;
  auto v = parse_i64(a.get(k));
  if (!v) return make_error(Errc::usage, "--" + k + " must be an integer, not " + a.get(k));
  return static_cast<int>(*v);
}

Result<std::vector<int>> int_list(const std::string& s) {
  std::vector<int> out;
  for (const auto& part : split_list(s)) {
    auto v = parse_i64(part);
    if (!v) return make_error(Errc::usage, "not an integer list: " + s);
    out.push_back(static_cast<int>(*v));
  }
  return out;
}

// Sets up the collective for --tp-size/--tp-rank (Gloo) or a single process.
Result<std::shared_ptr<Collective>> make_comm(const Args& a, bool on_cuda, int* rank, int* world) {
  auto w = int_opt(a, "tp-size", 1);
  auto r = int_opt(a, "tp-rank", 0);
  if (!w) return w.error();
  if (!r) return r.error();
  *world = *w;
  *rank = *r;
  const std::string coll = a.get("collective", "gloo");
  if (coll != "gloo" && coll != "nccl")
    return make_error(Errc::usage, "--collective must be gloo or nccl, not " + coll);
  if (*world == 1) return std::shared_ptr<Collective>(std::make_shared<LocalCollective>());
  const std::string store = a.get("store", "127.0.0.1:29551");
  auto colon = store.rfind(':');
  auto port = colon == std::string::npos ? std::nullopt : parse_i64(store.substr(colon + 1));
  if (!port) return make_error(Errc::usage, "--store must be HOST:PORT, not " + store);
  GlooOptions g;
  g.rank = *rank;
  g.world = *world;
  g.store_host = store.substr(0, colon);
  g.store_port = static_cast<int>(*port);
  g.bind_host = a.get("bind", "127.0.0.1");
  auto t = int_opt(a, "timeout-ms", 30000);
  if (!t) return t.error();
  g.timeout_ms = *t;
  auto c = GlooCollective::connect(g);
  if (!c) return c.error();
  if (!on_cuda) return std::shared_ptr<Collective>(*c);
  if (coll == "gloo")
    return std::shared_ptr<Collective>(std::make_shared<HostStagedCollective>(*c));
  // NCCL: the unique id through the same TCP store (rank 0 sets it, the others wait).
  auto client = TcpStoreClient::connect(g.store_host, g.store_port, std::chrono::milliseconds(*t));
  if (!client) return client.error();
  NcclOptions n;
  n.rank = *rank;
  n.world = *world;
  n.op_timeout = std::chrono::milliseconds(*t);
  auto share = [&](const std::string& key, const std::string& v) -> Result<std::string> {
    if (*rank == 0) {
      SPARK_TRY((*client)->set(key, v));
      return v;
    }
    SPARK_TRY((*client)->wait({key}, std::chrono::milliseconds(*t)));
    auto got = (*client)->try_get(key);
    if (!got) return got.error();
    if (!got->has_value()) return make_error(Errc::internal, "store key " + key + " vanished");
    return **got;
  };
  auto nc = NcclCollective::connect_via(n, share, *c);
  if (!nc) return nc.error();
  return std::shared_ptr<Collective>(*nc);
}

// VmHWM (peak resident set) of this process in bytes, from /proc/self/status.
uint64_t peak_rss_bytes() {
  auto text = read_file("/proc/self/status");
  if (!text) return 0;
  for (const auto& line : split_list(*text, '\n'))
    if (starts_with(line, "VmHWM:")) {
      auto v = parse_u64(trim(line.substr(6, line.size() - 6 - 3)));  // "VmHWM:   1234 kB"
      return v ? *v * 1024 : 0;
    }
  return 0;
}

int cmd_generate(const Args& a) {
  // Load first, then join: a slow loader delays the join instead of timing out a collective.
  auto w = int_opt(a, "tp-size", 1);
  auto r = int_opt(a, "tp-rank", 0);
  if (!w) return fail(w.error());
  if (!r) return fail(r.error());
  log::set_rank(*r);
  auto ordinal = int_opt(a, "device-ordinal", 0);
  if (!ordinal) return fail(ordinal.error());
  std::string fallback;
  auto dev = select_device(a.get("device", "cpu"), *ordinal, &fallback);
  if (!dev) return fail(dev.error());
  if (!fallback.empty()) std::fprintf(stderr, "spark-engine: %s\n", fallback.c_str());
  LoadReport load;
  auto split = plan::parse_moe_split(a.get("expert-parallel", "auto"));
  if (!split) return fail(split.error());
  load.expert_placement = *split;
  const uint64_t rss_before = peak_rss_bytes();
  auto model = Model::load(a.get("model"), *r, *w, *dev, &load);
  if (!model) return fail(model.error());
  const uint64_t rss_after = peak_rss_bytes();
  int rank = 0, world = 1;
  auto comm = make_comm(a, (*dev)->info().kind == "cuda", &rank, &world);
  if (!comm) return fail(comm.error());
  const std::string collective = world == 1                              ? "local"
                                 : (*dev)->info().kind != "cuda"         ? "gloo"
                                 : a.get("collective", "gloo") == "nccl" ? "nccl"
                                                                         : "gloo (host-staged)";
  const uint64_t captures_before = (*model)->graph_captures();
  Model* m = model->get();
  if (rank > 0) {
    TpWorkerStats ws;
    TpWorkerOptions wo;
    wo.stats = &ws;
    auto st = run_tp_worker(**model, **comm, wo);
    if (!st.ok()) return fail(st.error());
    std::cout << nlohmann::json{{"rank", rank},
                                {"worker", "stopped"},
                                {"plans", ws.plans},
                                {"plans_ahead", ws.plans_ahead},
                                {"plans_ready", ws.plans_ready},
                                {"plans_waited", ws.plans_waited},
                                {"decode_steps", ws.decode_steps},
                                {"decode_plans_ready", ws.decode_plans_ready},
                                {"digests_checked", ws.digests_checked},
                                {"tokens_drawn", ws.tokens},
                                {"bytes_read", load.bytes_read},
                                {"collective", collective},
                                {"graph_captures", m->graph_captures() - captures_before},
                                {"graph_replays", m->graph_replays()}}
                     .dump()
              << "\n";
    return 0;
  }
  auto prompt = int_list(a.get("prompt", "1,2,3"));
  if (!prompt) return fail(prompt.error());
  SamplingParams p;
  auto mt = int_opt(a, "max-tokens", 16);
  auto n = int_opt(a, "n", 1);
  if (!mt) return fail(mt.error());
  if (!n) return fail(n.error());
  p.max_tokens = *mt;
  p.n = *n;
  p.temperature = std::stof(a.get("temperature", "0"));
  p.top_p = std::stof(a.get("top-p", "1"));
  if (a.has("seed")) p.seed = std::stoull(a.get("seed"));
  p.ignore_eos = a.get("ignore-eos", "1") == "1";
  p.logprobs = a.get("logprobs", "0") == "1";
  EngineOptions o;
  auto slots = int_opt(a, "slots", 4);
  if (!slots) return fail(slots.error());
  o.slots = *slots;
  o.cuda_graphs = a.get("graphs", "1") == "1";
  o.overlap_plan = a.get("overlap", "1") == "1";
  auto ctl_timeout = int_opt(a, "timeout-ms", 30000);
  if (!ctl_timeout) return fail(ctl_timeout.error());
  o.control_timeout_ms = *ctl_timeout;
  auto eng = Engine::start(std::move(*model), *comm, o);
  if (!eng) return fail(eng.error());
  std::vector<int32_t> ids(prompt->begin(), prompt->end());
  auto res = generate_blocking(**eng, ids, p, 120000);
  const EngineStats es = (*eng)->stats();
  (*eng)->stop();
  if (!res) return fail(res.error());
  nlohmann::json j = {{"rank", 0},
                      {"tp", world},
                      {"tokens", res->tokens},
                      {"finish", nlohmann::json::array()},
                      {"bytes_read", load.bytes_read},
                      {"load_seconds", load.seconds},
                      {"weight_bytes", load.weight_bytes},
                      {"peak_rss_before_load", rss_before},
                      {"peak_rss_after_load", rss_after},
                      {"device", (*dev)->info().name},
                      {"device_kind", (*dev)->info().kind},
                      {"collective", collective},
                      {"graph_captures", m->graph_captures() - captures_before},
                      {"graph_replays", m->graph_replays()},
                      {"plans_posted", es.plans_posted},
                      {"plans_ahead", es.plans_ahead},
                      {"model_info", m->describe()}};
  if (p.logprobs) j["logprobs"] = res->logprobs;
  for (auto f : res->finish) j["finish"].push_back(finish_reason_name(f));
  std::cout << j.dump() << "\n";
  return 0;
}

int cmd_bench(const Args& a) {
  auto threads = int_opt(a, "threads", 1);
  if (!threads) return fail(threads.error());
  set_blas_threads(*threads);
  std::string dir = a.get("model");
  std::string tmp;
  if (dir.empty()) {  // --demo: the embedded demo checkpoint in a temporary directory
    char tmpl[] = "/tmp/spark-engine-demo-XXXXXX";
    if (!::mkdtemp(tmpl)) return fail(make_error(Errc::io, "mkdtemp failed"));
    tmp = tmpl;
    dir = tmp + "/demo";
    auto d = write_demo_model(dir, false);
    if (!d) return fail(d.error());
  }
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } cleanup{tmp};
  auto model = Model::load(dir, 0, 1);
  if (!model) return fail(model.error());
  auto conc = int_list(a.get("concurrency", "1,4"));
  auto pt = int_opt(a, "prompt-tokens", 32);
  auto mt = int_opt(a, "max-tokens", 64);
  auto slots = int_opt(a, "slots", 4);
  if (!conc) return fail(conc.error());
  if (!pt) return fail(pt.error());
  if (!mt) return fail(mt.error());
  if (!slots) return fail(slots.error());
  EngineOptions o;
  o.slots = *slots;
  o.prefix_caching = false;  // distinct prompts anyway; measure compute, not cache hits
  auto eng = Engine::start(std::move(*model), std::make_shared<LocalCollective>(), o);
  if (!eng) return fail(eng.error());
  auto rep = run_bench(**eng, *conc, *pt, *mt);
  (*eng)->stop();
  if (!rep) return fail(rep.error());
  rep->model = a.has("model") ? a.get("model") : "demo (sparkctl demo-model)";
  std::cout << (a.has("json") ? bench_json(*rep) : bench_table(*rep));
  return rep->ok() ? 0 : 1;
}

int cmd_gpubench(const Args& a) {
  auto r = run_gpu_bench(a.opt);
  if (!r) return fail(r.error());
  return *r;
}

}  // namespace

int main(int argc, char** argv) {
  log::set_level(log::Level::warn);
  if (const char* lv = std::getenv("SPARK_LOG_LEVEL")) {
    log::Level l;
    if (log::parse_level(lv, &l)) log::set_level(l);
  }
  auto a = parse(argc, argv);
  if (!a) return fail(a.error());
  try {
    if (a->cmd == "generate") return cmd_generate(*a);
    if (a->cmd == "bench") return cmd_bench(*a);
    if (a->cmd == "gpubench") return cmd_gpubench(*a);
    if (a->cmd == "tpbench") {
      auto r = run_tp_bench(a->opt);
      if (!r) return fail(r.error());
      return *r;
    }
  } catch (const std::exception& e) {
    return fail(make_error(Errc::usage, e.what()));
  }
  return fail(make_error(Errc::usage,
                         "unknown command " + a->cmd + " (generate, bench, gpubench, tpbench)"));
}
